"""The models generate drives (protocol.DenoiseModel): `reference` (the plain-torch oracle) and the fast `engine`
(the `forward` math behind a runner of CUDA graphs and staging, configured by `options.EngineOptions`); `denoiser`
says how a step meets the device for either."""
