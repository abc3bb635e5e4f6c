"""Several GPUs: the model's experts split over G ranks of one host (docs/ARCHITECTURE.md, 'Several GPUs').

  group     the ranks' process groups (gloo on the CPU, NCCL on GPUs), the collectives the model uses, the checks of
            `--gpus`, and the watchdog that ends a run whose ranks stop answering
  expert    one rank's share of the expert stacks (a tensor source that reads only that share) and the forward whose
            layers sum the ranks' expert contributions with one all-reduce
  engine    the engine every rank runs, and rank 0's model object (the Engine API), which hands each call to the
            other ranks before it runs it
  follower  the other ranks' loop: receive rank 0's calls, run the same forward

Starting the ranks (`--gpus G`, torchrun) lives in diffgemma/launch.py, above both this package and the loader.
"""
