# Sourced by the GPU scripts on the lent machine (see ../shared/device/README.md). It defines
#   gpu_install WHEEL...  the gathered onnxruntime-gpu parts (~/p/part0?) joined into one wheel, checked against
#                         .device/ort/SHA256 where that was carried, and installed with WHEELs into ~/site, once
#   gpu_package REPO [PKG]  the package mapping (export/ runtime/ models/ server/ -> systemone.*) as links in PKG
#                         (default ~/pkg)
# and, unless GPU_ENV_DEFINE_ONLY is set, runs both for this checkout and puts ~/site, ~/pkg and it on PYTHONPATH.
ORT_WHEEL=~/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl

gpu_install() {
  [ ! -d ~/site/onnxruntime ] || return 0
  cat ~/p/part0? > "$ORT_WHEEL" || return 1
  local got want
  got=$(sha256sum "$ORT_WHEEL" | cut -d' ' -f1); want=$(cat .device/ort/SHA256 2>/dev/null || echo "$got")
  [ "$got" = "$want" ] || { echo "the gathered wheel's sha256 $got is not prepare.sh's $want" >&2; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target ~/site "$ORT_WHEEL" "$@"
}

gpu_package() {
  local d pkg=${2:-~/pkg}
  mkdir -p "$pkg"/systemone && cp "$1"/systemone/*.py "$pkg"/systemone/
  for d in export runtime models server; do ln -sfn "$1/$d" "$pkg"/systemone/$d; done
}

if [ -z "${GPU_ENV_DEFINE_ONLY:-}" ]; then
  shopt -s nullglob
  gpu_install .device/wheels/*.whl
  gpu_package "$PWD"
  export PYTHONPATH=~/site:~/pkg:$PWD
fi
