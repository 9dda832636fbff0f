"""What makes a built model fast, in one place: `accelerate(model, plan, runtime)` applies every rewrite in
one stated order (`ctrflow.accel.accelerate`'s module doc), after `plan_run` resolved the run's choices
(`ctrflow.accel.plan`).

The building blocks know no model class; they act on a model's named parts (`embeddings`, `interaction`,
`over_arch`, ...) and on what it declares about itself. Models import nothing of this package.

- `plan`: the `RunPlan` (fused or plain tables, sharding, dense sync, CUDA graphs, compile, precision);
- `accelerate`: the rewrites applied in order;
- `fp8/`: fp8 Linear layers and DCNv2-style cross nets in fp8 row kernels;
- `dense`: Linear inputs aligned for the tensor cores, dense parts compiled;
- `fused`: the fused tables swapped in and their optimizer face (`FusedTables`);
- `interaction`: the dot interaction in Triton kernels;
- `parallelize`: sharded tables and data-parallel dense parts over N processes;
- `exchange`: the sharded exchange overlapped with the dense layers and read in place;
- `dense_average`: the dense gradients averaged by the step (no DDP hooks);
- `graphs`: the whole step replayed as one CUDA graph.
"""
