#!/usr/bin/env bash
# FlashAttention-4 (the bench's `fa4` peer: pip flash-attn-4 and NVIDIA's CuTe DSL) for a GPU
# machine that cannot reach PyPI. Its CUDA 13 library wheel (~92 MB) is larger than one device
# call may carry (64 MiB with the tree), so it travels as an xz tarball in two halves, in two
# calls to the same warm machine (it goes back after 30 s idle: make the second call at once).
#
#   bash benchmarks/fa4_wheels.sh pack              # here, with PyPI: fills .fa4/ (git-ignored)
#   call 1, carry [".fa4/one"]:           bash benchmarks/fa4_wheels.sh stash
#   call 2, carry [".fa4/two", ".fa4/small"]: bash benchmarks/fa4_wheels.sh install && . /tmp/fa4.env && ...
#
# install unpacks into /tmp/fa4site and writes /tmp/fa4.env (PYTHONPATH with the DSL's own
# package folder, which its wheel's .pth file would add in a site-packages install, and the
# DSL's compile cache on). Versions: FA4 and DSL as below, Python 3.12 x86-64 (the image's).
set -euo pipefail
cd "$(dirname "$0")/.."
FA4=4.0.0b36
DSL=4.8.1
PY=3.12
case "${1:-}" in
pack)
    rm -rf .fa4 && mkdir -p .fa4/small .fa4/one .fa4/two .fa4/tmp
    dl() {
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY" \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}"
    }
    dl .fa4/small "flash-attn-4==$FA4" "nvidia-cutlass-dsl-libs-base==$DSL" \
        "nvidia-cutlass-dsl-libs-core==$DSL" "apache-tvm-ffi<0.2,>=0.1.11" torch-c-dlpack-ext quack-kernels
    dl .fa4/tmp "nvidia-cutlass-dsl-libs-cu13==$DSL"
    (cd .fa4/tmp && python3 -m zipfile -e nvidia_cutlass_dsl_libs_cu13-*.whl unpacked &&
     tar -C unpacked -cf - . | xz -T0 -6 > ../cu13.tar.xz)
    rm -rf .fa4/tmp
    split -n 2 .fa4/cu13.tar.xz .fa4/cu13.part.
    mv .fa4/cu13.part.aa .fa4/one/ && mv .fa4/cu13.part.ab .fa4/two/ && rm .fa4/cu13.tar.xz
    du -sh .fa4/*
    ;;
stash)
    mkdir -p /tmp/fa4parts && cp .fa4/one/cu13.part.aa /tmp/fa4parts/ && echo "stashed"
    ;;
install)
    [ -f /tmp/fa4parts/cu13.part.aa ] || { echo "no first half: run stash on this machine first" >&2; exit 3; }
    mkdir -p /tmp/fa4site
    cat /tmp/fa4parts/cu13.part.aa .fa4/two/cu13.part.ab | xz -d -T0 | tar -xf - -C /tmp/fa4site
    for w in .fa4/small/*.whl; do python3 -m zipfile -e "$w" /tmp/fa4site; done
    cat > /tmp/fa4.env <<ENV
export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4cache
ENV
    echo "installed: . /tmp/fa4.env"
    ;;
*)
    echo "usage: $0 pack | stash | install" >&2
    exit 2
    ;;
esac
