"""Several GPUs: one video computed by a group of processes, one per GPU.

- layout.py: which token rows each rank holds (padded to equal shards);
- ulysses.py / ring.py: self-attention over the whole sequence from the local shards;
- sequence_split.py: the DiT's hook (WanDiT.forward(sequence=...)) that shards the tokens,
  the rotary table and the timestep modulation by global position and gathers the output;
- cfg_parallel.py: the conditional and unconditional passes on two halves of the group;
- sharded_blocks.py: opt-in sharding of the transformer blocks (the `fsdp` setting), gathered
  block by block through a ring of device buffers;
- group.py / worker.py / launch.py / messages.py: the warm worker group the sampler drives
  (torch.distributed: NCCL between GPUs, gloo on the CPU and for control), how its ranks start,
  and what travels on their pipes;
- sampler.py (the driver's side of a sampler run) / sampling.py (the ranks' denoise loop),
  tasks.py, models.py, memory.py, metrics.py, golden.py.
"""
