"""What the train task asks the cluster for, decided at run time from the pipeline parameters."""

from kfp import dsl

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def accelerator_type(num_gpus: int, gpu_type: str) -> str:
    """The train task's accelerator type: `gpu_type`, or "" when `num_gpus` is 0. The KFP driver
    adds a resource limit only when both the type and the count resolve non-empty, so a CPU run
    becomes a plain CPU pod (a `nvidia.com/gpu: 0` limit would still let the pod tolerate the GPU
    nodes' taints and land there)."""
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be 0 or more, got {num_gpus}")
    return gpu_type if num_gpus > 0 else ""
