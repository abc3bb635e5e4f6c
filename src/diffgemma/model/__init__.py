"""Model implementations: `reference` (plain torch oracle) and, on CUDA, the fast `engine`."""
