# Sourced by the GPU checks on the lent machine (see ../shared/device/README.md): install the gathered
# onnxruntime-gpu parts and the carried wheels once, mirror the package mapping (export/ runtime/ models/ server/
# -> systemone.*) with links, and put both on PYTHONPATH.
wheel=~/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
if [ ! -d ~/site/onnxruntime ]; then
  cat ~/p/part0? > "$wheel"
  shopt -s nullglob
  python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site "$wheel" .device/wheels/*.whl
fi
mkdir -p ~/pkg/systemone
cp systemone/*.py ~/pkg/systemone/
for d in export runtime models server; do ln -sfn "$PWD/$d" ~/pkg/systemone/$d; done
export PYTHONPATH=~/site:~/pkg:$PWD
