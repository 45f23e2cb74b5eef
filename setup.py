"""moe_jax: sparse MoE language models with hybrid KDA / MLA attention in JAX."""

from setuptools import find_packages, setup

setup(
    name="moe_jax",
    version="0.1.0",
    description="Sparse Mixture-of-Experts LMs with hybrid linear attention (JAX/Flax/Pallas).",
    packages=find_packages(include=["moe_jax", "moe_jax.*", "pallas_kernels", "pallas_kernels.*", "configs"]),
    python_requires=">=3.12",
    install_requires=[
        "jax==0.11.2",
        "jaxlib==0.11.2",
        "flax==0.12.10",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.4",
        "grain==0.2.18",
        "ml-collections==1.1.0",
        "absl-py>=2.1",
        "tqdm>=4.66",
        "tensorboardX==2.6.5",
        "numpy>=2.0",
    ],
    extras_require={
        # plots: scripts/plot_metrics.py; scikit-learn: the digits image task (tests use it)
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "matplotlib>=3.8", "scikit-learn==1.9.1"],
        "vision": ["scikit-learn==1.9.1", "pillow>=10"],   # image tasks, PNG prompts
        # CUDA wheels for jaxlib; tokamax's grouped matmul is imported lazily (heavy deps).
        "gpu": ["jax[cuda13]==0.11.2", "tokamax==0.0.17"],
        "tpu": ["jax[tpu]==0.11.2", "tokamax==0.0.17"],
    },
)
