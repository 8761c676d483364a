#!/usr/bin/env bash
# The GPU checks of issues 9 and 11, as they were run on a lent machine (one H100, 16 cores,
# no network; its Python has torch, timm, numpy, scipy and scikit-learn, not the service's
# packages). Usage, from the repository root, one or more sections:
#
#   OUT=/tmp/gpu bash benchmarks/gpu_checks.sh setup cuda-tests hooks train transfer iteration
#
# Extra options for the transfer, iteration, hooks, host and select scripts go in
# TRANSFER_ARGS / ITERATION_ARGS / HOOKS_ARGS / HOST_ARGS / SELECT_ARGS. zoopick.training
# imports pydantic, which the image lacks: carry its wheels in .whl/ (benchmarks/comm/README.md,
# issue 19).
#
# Made here, carried to the device (both git-ignored): .whl/ = `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl` of
# pydantic, pydantic-core, pydantic-settings, python-dotenv, typing-inspection,
# annotated-types, celery, kombu, billiard, vine, amqp, click-didyoumean, click-plugins,
# click-repl, prompt_toolkit, wcwidth, tzlocal (the versions installed here); .ipr/ =
# `apt-get download iproute2 libbpf1 libelf1 libmnl0 libcap2 libxtables12 libtirpc3 libdb5.3
# libbsd0 libmd0 libselinux1 libpcre2-8-0 libgssapi-krb5-2 libkrb5-3 libk5crypto3
# libkrb5support0 libcom-err2 libkeyutils1`. The zoo (benchmarks/transfer/build_zoo.py) is
# carried too: `carry: [".whl", ".ipr", "benchmarks/transfer/zoo"]`.
# setup       the package (editable, no deps); wheels in .whl/ (pydantic, celery... for the
#             `zoopick` CLI) and Debian's iproute2 in .ipr/ (for the network namespaces of the
#             comm benchmark) when those folders are there
# cuda-tests  tests/test_comm_cuda.py (hooks on CUDA tensors, no synchronising call),
#             tests/test_comm_triton.py (the fused Triton selection, compiled, against torch)
#             and tests/test_comm_graphs.py (CUDA graphs replay the eager steps bit for bit)
# hooks       benchmarks/comm/gpu_hooks.py (issue 19: ResNet-50 and ViT-B/16 at 25 and 100 MB
#             buckets, plain, +triton and +graph (CUDA graphs), with and without async_comm,
#             interleaved rounds; profiler table, goals; extra options in HOOKS_ARGS)
# host        benchmarks/comm/gpu_host.py (issue 19: where each hook's host time goes, by
#             operator and CUDA runtime call; extra options in HOST_ARGS)
# select      benchmarks/comm/gpu_select.py (issue 19: the selection kernels alone on a real
#             ResNet-50 gradient, torch.topk against the fused Triton select, bracket and
#             radix, at several program sizes; extra options in SELECT_ARGS)
# train       `zoopick train` on the GPU (bf16 autocast, channels_last, NCCL at world size 1)
#             with dense, spardl and spardl on the side stream
# transfer    benchmarks/transfer/gpu_check.py (needs benchmarks/transfer/zoo)
# iteration   benchmarks/comm/run.py --mode iteration, one core per worker, P = 3..8
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

setup() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e . || return 1
    if compgen -G ".ipr/*.deb" >/dev/null && ! command -v ip >/dev/null; then
        mkdir -p /tmp/ipr /tmp/iprbin
        for f in .ipr/*.deb; do dpkg -x "$f" /tmp/ipr; done
        for t in ip tc; do
            src=$(ls /tmp/ipr/{bin,sbin,usr/bin,usr/sbin}/$t 2>/dev/null | head -1)
            printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/ipr/lib/x86_64-linux-gnu:/tmp/ipr/usr/lib/x86_64-linux-gnu exec %s "$@"\n' \
                "$src" >/tmp/iprbin/$t
            chmod +x /tmp/iprbin/$t
        done
    fi
}

env_paths() {
    [ -d /tmp/site ] && export PYTHONPATH=/tmp/site
    [ -d /tmp/iprbin ] && export PATH=/tmp/iprbin:$PATH
    return 0
}

cuda_tests() {
    python3 -m pytest -q -p no:cacheprovider tests/test_comm_cuda.py tests/test_comm_triton.py \
        tests/test_comm_graphs.py 2>&1 |
        tee "$OUT/cuda_tests.log" | tail -15
}

hooks() {
    # shellcheck disable=SC2086
    python3 benchmarks/comm/gpu_hooks.py --out "$OUT" ${HOOKS_ARGS:-} 2>&1 | tee "$OUT/gpu_hooks.log"
}

host() {
    # shellcheck disable=SC2086
    python3 benchmarks/comm/gpu_host.py --out "$OUT" ${HOST_ARGS:-} 2>&1 | tee "$OUT/gpu_host.log"
}

select_kernels() {
    # shellcheck disable=SC2086
    python3 benchmarks/comm/gpu_select.py --out "$OUT" ${SELECT_ARGS:-} 2>&1 | tee "$OUT/gpu_select.log"
}

train() {
    local zoo=/tmp/zoo_r50.json data=benchmarks/transfer/zoo/targets
    printf '{"models": [{"id": "r50", "arch": "resnet50", "weights": "none", "num_classes": 1000, "input_size": [3, 224, 224]}]}\n' >$zoo
    local n=0
    for run in "dense" "spardl" "spardl --hook-option async_comm=true"; do
        n=$((n + 1))
        echo "== zoopick train --compressor $run" | tee -a "$OUT/train.log"
        # shellcheck disable=SC2086
        python3 -m zoopick train --zoo $zoo --model r50 --data $data/glyphs-train.npz \
            --test-data $data/glyphs-test.npz --workers 1 --epochs 3 --batch-size 32 \
            --lr 0.01 --out /tmp/run_$n --json --compressor $run 2>&1 | tee -a "$OUT/train.log"
        echo "exit $?" | tee -a "$OUT/train.log"
    done
}

transfer() {
    # shellcheck disable=SC2086
    python3 benchmarks/transfer/gpu_check.py --zoo benchmarks/transfer/zoo --out "$OUT" \
        ${TRANSFER_ARGS:-}
}

iteration() {
    python3 - <<'EOF' 2>&1 | tee "$OUT/netns.log"
import sys; sys.path.insert(0, "benchmarks/comm")
import netns; print("namespaces:", netns.available())
EOF
    # CPU workers: with a GPU visible, torch's PowerSGD hook calls torch.cuda.synchronize on
    # the CPU device and fails, so the GPU is hidden from them
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES= python3 benchmarks/comm/run.py --mode iteration --workers 3,4,5,6,7,8 --densities 0.01 \
        --links 1000 --hooks dense,powersgd,topk,gaussiank,spardl,spardl-async,spardl-t2 --iters 4 \
        --warmup 1 --px 96 --batch 2 --timeout 500 --pin-from 1 --no-plots --out "$OUT" ${ITERATION_ARGS:-}
}

env_paths
failed=""
for section in "$@"; do
    echo "=== $section $(date +%T)"
    case $section in
        setup) setup && env_paths ;;
        cuda-tests) cuda_tests ;;
        hooks) hooks ;;
        host) host ;;
        select) select_kernels ;;
        train) train ;;
        transfer) transfer ;;
        iteration) iteration ;;
        *) echo "unknown section $section" >&2; exit 2 ;;
    esac || failed="$failed $section"
done
echo "=== done $(date +%T)${failed:+, failed:$failed}"
# a failed section fails the script, so that `gpu_checks.sh cuda-tests && ...` stops there
[ -z "$failed" ]
