#!/usr/bin/env bash
# Downloads, here, the wheels the lent GPU machine lacks (Python 3.12, manylinux x86-64) into .whl/
# (ignored): what slipstream and benchmarks/gpu_check.sh import there beyond the machine's own torch,
# transformers, peft, accelerate, tokenizers, pyyaml, rich, tqdm and setuptools. The device call
# carries .whl (64 MiB in all with the tree); gpu_check.sh installs them with pip --no-index.
#
#   bash benchmarks/gpu_wheels.sh                # matplotlib (the A/B plots) and liger-kernel: ~20 MB
#   WITH_TRL=1 bash benchmarks/gpu_wheels.sh     # + TRL and datasets with pyarrow and pandas (~70 MB)
#   WITH_BITSANDBYTES=1 bash benchmarks/gpu_wheels.sh   # + bitsandbytes (~60 MB)
# Either extra alone is over the 64 MiB a device call carries with the tree, so by default the trl
# arm and the QLoRA paths are skipped there with the reason (not installed).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
rm -rf "$dest" && mkdir -p "$dest"  # one version of each: two stop the install
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
fetch() {  # NAME==VERSION ...: binary wheels only, none of their needs (named here one by one)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dest" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
# the A/B plots: matplotlib and what it imports (numpy, packaging come with torch / transformers)
fetch matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.60.1 kiwisolver==1.4.9 \
  pillow==12.0.0 pyparsing==3.2.5 python-dateutil==2.9.0.post0 six==1.17.0
# the trl arm: TRL and datasets (TRL imports it) with datasets' own needs
[ "${WITH_TRL:-0}" = 1 ] && fetch trl==1.16.0 datasets==5.2.0 dill==0.4.0 multiprocess==0.70.18 xxhash==3.6.0 fsspec==2025.10.0 \
  pyarrow==26.0.1 pandas==2.3.3 pytz==2025.2 tzdata==2025.2
# the liger arm and fused kernels (Triton comes with a CUDA torch)
fetch liger-kernel==0.6.4
if [ "${WITH_BITSANDBYTES:-0}" = 1 ]; then fetch bitsandbytes==0.50.2; fi
ls "$dest"
du -sh "$dest"
