#!/usr/bin/env bash
# The wheels to carry to the H200 (the device tool carries 64 MiB with the tracked tree):
#   .whl_gpu   the full suite, notebooks included: ../shared/device/wheels.sh's .whl, less
#              what the GPU image already has (scikit-learn) or the suite does not use (fla,
#              cryptography; xprof goes to .whl_prof), plus nbclient / ipykernel and their
#              dependencies and the pinned sentencepiece / tokenizers;
#   .whl_ref   transformers 5.23, the pinned reference (the image's 5.17 has a Kimi Linear
#              that differs: its cache and expert-mask code), for the live comparison in
#              tests/test_kimi_hf.py: gpu_suite.sh makes a reference Python of it;
#   .whl_prof  xprof (32 MiB): `import tokamax` imports it (tokamax.benchmarking), and the
#              benchmarks' profiles read with it (bench_train --profile);
#   .whl_run   .whl_gpu without the notebook wheels (18 MiB): with .whl_prof, what the
#              device jobs that run no notebook carry (benchmarks/gpu_runs.sh,
#              benchmarks/train_variants.sh: WHEELS=".whl_run .whl_prof").
#   bash tests/gpu_wheels.sh            (run from the repo root, after wheels.sh)
# With the tracked tree (8 MB) all three exceed 64 MiB, so the suite's halves carry
# [".whl_gpu", ".whl_prof"] (kernels: tokamax) and [".whl_gpu", ".whl_ref"] (rest).
set -euo pipefail
[ -d .whl ] || { echo "run ../shared/device/wheels.sh first (.whl is missing)" >&2; exit 1; }
rm -rf .whl_gpu .whl_ref .whl_prof .whl_run /tmp/moe_jax_nb_wheels
mkdir -p .whl_gpu .whl_ref .whl_prof .whl_run /tmp/moe_jax_nb_wheels
cp .whl/*.whl .whl_gpu/
rm -f .whl_gpu/scikit_learn-* .whl_gpu/fla_core-* .whl_gpu/flash_linear_attention-*
rm -f .whl_gpu/cryptography-*   # google-auth's optional extra (GCS paths): no test reaches it
mv .whl_gpu/xprof-* .whl_prof/
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl_ref transformers==5.23.0
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d /tmp/moe_jax_nb_wheels \
  nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl_gpu \
  sentencepiece==0.2.3 tokenizers==0.23.3   # (their other dependencies are in the image)
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl_gpu \
  jaxtyping==0.3.11 wadler_lindig==0.1.8    # tokamax's KDA (tests/test_kda_tpu.py)
cp .whl_gpu/*.whl .whl_run/       # before the notebook wheels join .whl_gpu
for f in /tmp/moe_jax_nb_wheels/*.whl; do
  case $(basename "$f") in   # in the image already, or optional (debugpy: the kernel's debugger; jedi: completion)
    attrs-*|packaging-*|psutil-*|pygments-*|python_dateutil-*|typing_extensions-*|tzdata-*|debugpy-*|jedi-*) ;;
    *) cp "$f" .whl_gpu/ ;;
  esac
done
du -sh .whl_gpu .whl_ref .whl_prof .whl_run
