#!/usr/bin/env bash
# The README's GPU figures ("Accelerator throughput", and the slot engine's) as JSON lines,
# in twelve parts that each fit a 10-minute command:
#
#   bash benchmarks/gpu_report.sh mlp            # the Pallas MLP kernel alone under a grid of
#                                                # settings beside XLA's, then decode with it
#                                                # (at its fastest) beside decode without it
#   bash benchmarks/gpu_report.sh projection     # the Pallas output-projection kernel alone
#                                                # under a grid of settings beside XLA's
#                                                # matmul, then decode with it (at the down
#                                                # projection's fastest) beside without it,
#                                                # and a profile of decode with all three
#   bash benchmarks/gpu_report.sh qkv            # the Pallas attention-input kernel (norm,
#                                                # Q/K/V, rotary, cache write) alone under a
#                                                # grid of settings beside XLA's kernels,
#                                                # then decode with all four decode kernels
#                                                # (it at its fastest) beside the other
#                                                # three, and with one-part projections (five
#                                                # kernels a layer), profiled so at 0.5b
#   bash benchmarks/gpu_report.sh fused PEER     # decode with all four decode kernels at
#                                                # their defaults, the output projections in
#                                                # four parts and in one, at 3 shapes, beside
#                                                # transformers' generate (PEER, as below):
#                                                # issue 14's decode figures in one command
#   bash benchmarks/gpu_report.sh decode  PEER   # the Pallas decode-attention kernel alone
#                                                # under a grid of settings, then decode at 3
#                                                # shapes (cudnn; the kernel at its fastest
#                                                # settings) beside transformers' generate
#                                                # (PEER: a copy of
#                                                # ../shared/bench/hf_generate_baseline.py)
#   bash benchmarks/gpu_report.sh decode_more    # decode with einsum attention, on float32
#                                                # params, and with cuBLAS's matmuls
#   bash benchmarks/gpu_report.sh learner        # learner MFU, scoring, publish, profiles
#   bash benchmarks/gpu_report.sh learner_1.5b   # the 1.5b learner step unscanned beside
#                                                # scanned (a GPU of >= 120 GB: an H200)
#   bash benchmarks/gpu_report.sh engine [FLAGS] # batch-then-score vs the slot engine (FLAGS:
#                                                # more engine_speed.py flags, e.g.
#                                                # --attention=cudnn --decode_attention=pallas
#                                                # --decode_mlp=pallas --decode_projection=pallas)
#   bash benchmarks/gpu_report.sh reward_model   # reward-model steps: time, MFU, peak memory
#   bash benchmarks/gpu_report.sh smoke_tldr     # the paper-scale smoke runs, one a part
#   bash benchmarks/gpu_report.sh smoke_gsm8k GSM8K [SET]  # (GSM8K: a folder with GSM8K's
#                                                # train.jsonl and test.jsonl; SET: more
#                                                # overrides for paper_smoke.py's --set, e.g.
#                                                # search.engine=slots)
#
# Each line of benchmarks/gpu_throughput.py, the peer and benchmarks/paper_smoke.py is
# printed as it comes; "=== ..." lines name the command before them. Library chatter is
# dropped. REPORT_TIMEOUT sets the seconds each command may take (default 240; 560 for a
# smoke run).
set -u
PARTS="mlp | projection | qkv | fused PEER | decode PEER | decode_more | learner | learner_1.5b | engine [FLAGS] | reward_model | smoke_tldr | smoke_gsm8k GSM8K_DIR [SET]"
usage() {  # one line on stderr, exit status 2
  echo "error: $1; usage: bash benchmarks/gpu_report.sh $PARTS" >&2
  exit 2
}
[ $# -ge 1 ] || usage "name the part to run"
part=$1
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
limit=${REPORT_TIMEOUT:-240}
G="python3 benchmarks/gpu_throughput.py"

run() {
  echo "=== ${XLA_FLAGS:+XLA_FLAGS=$XLA_FLAGS }$*"
  timeout "$limit" "$@" 2>&1 | grep -v '^WARNING\|^I0000\|^W0000\|^[IW][0-9]\{4\} '
}

fastest_in() {  # FILE PATTERN: the settings the kernel benchmark's first line with PATTERN
  # timed fastest: cold (inputs no cache holds, as in a decode step) where it timed them so
  grep "$2" "$1" | python3 -c 'import json, sys
line = json.loads(sys.stdin.readline())
print(line.get("fastest_cold", line["fastest"]))' 2>/dev/null
}

kernel_then_decode() {  # KNOB BENCHMARK PATTERN FLAGS [MORE]: for 0.5b and 1.5b, the
  # decode kernel's benchmark (benchmarks/BENCHMARK at 64 and 256 rows), then decode with
  # --KNOB=same and --KNOB=pallas (at the settings the benchmark's first line with PATTERN
  # timed fastest), both with FLAGS, and with MORE flags a third time with --KNOB=pallas;
  # profile_kernel: the 0.5b fastest
  local knob=$1 benchmark=$2 pattern=$3 flags=$4 more=${5:-} shape value kernel_lines fastest
  profile_kernel=""
  for shape in qwen2.5-0.5b qwen2.5-1.5b; do
    kernel_lines=$(mktemp)
    run python3 "benchmarks/$benchmark" --shape=$shape --rows=64,256 | tee "$kernel_lines"
    fastest=$(fastest_in "$kernel_lines" "$pattern")
    rm -f "$kernel_lines"
    for value in same pallas; do
      # shellcheck disable=SC2086  # FLAGS: several flags
      run $G --shape=$shape --batch=256 --prompt=256 --new=256 --skip=score,train $flags \
        --$knob=$value --${knob}_kernel="$([ $value = pallas ] && echo "${fastest:-}")"
    done
    if [ -n "$more" ]; then
      # shellcheck disable=SC2086
      run $G --shape=$shape --batch=256 --prompt=256 --new=256 --skip=score,train $flags \
        --$knob=pallas --${knob}_kernel="${fastest:-}" $more
    fi
    [ $shape = qwen2.5-0.5b ] && profile_kernel=${fastest:-}
  done
}

case "$part" in
  mlp)
    # a decode step's gated hidden layer, act(x W_gate) * (x W_up), as one Pallas kernel
    # against float64 and beside XLA's merged gate|up matmul and its multiply (22 + 5 us a
    # layer on an H100 at 0.5b, batch 256, where the weights' bytes take 5 us); decode then
    # takes the fastest settings at 256 rows, beside decode without the kernel
    kernel_then_decode decode_mlp gated_mlp_kernel.py '"rows": 256' \
      "--attention=cudnn --decode_attention=pallas"
    ;;
  projection)
    # a decode step's output projections (attention's W_o, the MLP's W_down) as one Pallas
    # kernel that splits the contraction between programs, beside XLA's matmul (on an H200
    # at 0.5b, batch 256, the down projection took 17.4 us a layer where its 8.7 MB of
    # weights take 1.8 us); decode then takes the down projection's fastest settings at 256
    # rows, beside decode without the kernel (both with the other two decode kernels); then
    # one more 0.5b run with it, profiled kernel by kernel (command buffers off)
    kernel_then_decode decode_projection decode_projection_kernel.py \
      '"projection": "mlp_down", "rows": 256' \
      "--attention=cudnn --decode_attention=pallas --decode_mlp=pallas"
    XLA_FLAGS=--xla_gpu_enable_command_buffer= run $G --shape=qwen2.5-0.5b --batch=256 \
      --prompt=256 --new=256 --skip=score,train --repeats=1 --attention=cudnn \
      --decode_attention=pallas --decode_mlp=pallas --decode_projection=pallas \
      --decode_projection_kernel="$profile_kernel" --profile=30
    ;;
  qkv)
    # a decode step's attention input as one Pallas kernel (XLA: five kernels a layer, the
    # norm, the Q|K|V matmul and one each for Q, K and V's sums, rotary and cache writes);
    # decode then takes its fastest settings at 256 rows, beside decode without it (both
    # with the other three decode kernels at their defaults), and once more with the
    # output projections in one part, which add the residual stream themselves (five
    # kernels a layer); then one more 0.5b run so, profiled kernel by kernel (command
    # buffers off)
    one_part=--decode_projection_kernel=64:64:64:1:4:3
    kernel_then_decode decode_qkv decode_qkv_kernel.py '"rows": 256' \
      "--attention=cudnn --decode_attention=pallas --decode_mlp=pallas --decode_projection=pallas" \
      "$one_part"
    XLA_FLAGS=--xla_gpu_enable_command_buffer= run $G --shape=qwen2.5-0.5b --batch=256 \
      --prompt=256 --new=256 --skip=score,train --repeats=1 --attention=cudnn \
      --decode_attention=pallas --decode_mlp=pallas --decode_projection=pallas $one_part \
      --decode_qkv=pallas --decode_qkv_kernel="$profile_kernel" --profile=30
    ;;
  fused)
    [ $# -ge 2 ] || usage "fused needs the peer script's path (PEER)"
    peer=$2
    # every decode kernel at the model's settings (no kernel benchmark first: the fewest
    # compiles), the projections in four parts and then in one (adding the residual
    # stream: five kernels a layer), each shape beside the peer in this same command
    kernels="--attention=cudnn --decode_attention=pallas --decode_mlp=pallas"
    kernels="$kernels --decode_projection=pallas --decode_qkv=pallas"
    for shape in "qwen2.5-0.5b 256" "qwen2.5-1.5b 256" "qwen2.5-0.5b 64"; do
      set -- $shape
      run python3 "$peer" --shape "$1" --batch "$2" --prompt 256 --new 256
      for projection in "" --decode_projection_kernel=64:64:64:1:4:3; do
        # shellcheck disable=SC2086  # several flags
        run $G --shape="$1" --batch="$2" --prompt=256 --new=256 --skip=score,train \
          $kernels $projection
      done
    done
    ;;
  decode)
    [ $# -ge 2 ] || usage "decode needs the peer script's path (PEER)"
    peer=$2
    # the Pallas decode-attention kernel against float64, and one layer's time under a grid
    # of its settings beside cuDNN's; decode then runs with the fastest at 512 cache slots
    kernel_lines=$(mktemp)
    run python3 benchmarks/decode_attention_kernel.py --attention=cudnn | tee "$kernel_lines"
    fastest=$(fastest_in "$kernel_lines" '"cache_len": 512')
    rm -f "$kernel_lines"
    for shape in "qwen2.5-0.5b 256" "qwen2.5-1.5b 256" "qwen2.5-0.5b 64"; do
      set -- $shape
      run python3 "$peer" --shape "$1" --batch "$2" --prompt 256 --new 256
      run $G --shape="$1" --batch="$2" --prompt=256 --new=256 --skip=score,train --attention=cudnn
      run $G --shape="$1" --batch="$2" --prompt=256 --new=256 --skip=score,train --attention=cudnn \
        --decode_attention=pallas --decode_kernel="${fastest:-}"
    done
    ;;
  decode_more)
    for shape in "qwen2.5-0.5b 256" "qwen2.5-1.5b 256" "qwen2.5-0.5b 64"; do
      set -- $shape
      run $G --shape="$1" --batch="$2" --prompt=256 --new=256 --skip=score,train
    done
    # as a run's searchers decode: the learner's float32 params, cast once per call
    run $G --shape=qwen2.5-0.5b --batch=256 --prompt=256 --new=256 --skip=score,train \
      --attention=cudnn --param_dtype=float32
    # the 256-row projections as XLA's Triton matmuls (the default), then as cuBLAS's: they
    # take about half a step's kernel time, each ~4x what its bytes need (README's profile).
    # cuBLAS's alone concatenates the gate|up and Q|K|V weights XLA merged into one product
    # at every step (compiled without a GPU: 4.67 GB a step, 337 kernels); unmerged, the
    # products read their weights in place (4.10 GB, 433 kernels; the default: 4.35 GB, 312)
    for xla_flags in "" "--xla_gpu_enable_triton_gemm=false" \
      "--xla_gpu_enable_triton_gemm=false --xla_gpu_dot_merger_threshold_mb=0"; do
      XLA_FLAGS=$xla_flags run $G --shape=qwen2.5-0.5b --batch=256 --prompt=256 --new=256 \
        --skip=score,train --attention=cudnn --decode_attention=pallas
    done
    ;;
  learner)
    run $G --shape=qwen2.5-0.5b --prompt=512 --new=512 --skip=decode,score --attention=cudnn --profile=12
    run $G --shape=qwen2.5-0.5b --prompt=512 --new=512 --skip=decode,score --attention=cudnn \
      --scan_layers --remat=dots_with_no_batch_dims_saveable
    run $G --shape=qwen2.5-1.5b --prompt=512 --new=512 --skip=decode,score --attention=cudnn \
      --scan_layers --remat=dots_with_no_batch_dims_saveable
    run $G --shape=qwen2.5-0.5b --batch=256 --prompt=256 --new=256 --skip=decode,train --attention=cudnn
    run python3 benchmarks/publish_cost.py --full_width --compute_dtype=bfloat16
    run python3 benchmarks/publish_cost.py --full_width --scan_layers --compute_dtype=bfloat16
    # decode's kernels one by one (command buffers off), then with cuBLAS's matmuls instead of
    # XLA's Triton ones (compiled without a GPU the 256-row projections are split-K Triton
    # kernels; the profile shows what the autotuner picked)
    XLA_FLAGS=--xla_gpu_enable_command_buffer= run $G --shape=qwen2.5-0.5b --batch=256 \
      --prompt=256 --new=256 --skip=score,train --repeats=1 --attention=cudnn --profile=30
    XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_enable_triton_gemm=false" run $G \
      --shape=qwen2.5-0.5b --batch=256 --prompt=256 --new=256 --skip=score,train --repeats=1 \
      --attention=cudnn --profile=30
    ;;
  learner_1.5b)
    # unscanned, the qwen2.5-1.5b step plans 69.7 GiB (static_profile --target=h200): it did
    # not fit an 80 GB H100 even at 95% of its memory, and should fit an H200's 141 GB
    memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    if [ "${memory_mib:-0}" -lt 120000 ]; then
      echo "error: learner_1.5b needs a GPU of >= 120 GB (this one: ${memory_mib:-?} MiB)" >&2
      exit 2
    fi
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
    run $G --shape=qwen2.5-1.5b --prompt=512 --new=512 --skip=decode,score --attention=cudnn
    run $G --shape=qwen2.5-1.5b --prompt=512 --new=512 --skip=decode,score --attention=cudnn \
      --scan_layers --remat=dots_with_no_batch_dims_saveable
    ;;
  engine)
    # issue 11's GPU half: batch-then-score against the slot engine at the GSM8K searcher's
    # shape (rho-1b in bfloat16, 3 prompts × S = 24 rows a call, 256 + 512 tokens); the
    # long-tailed mix's EOS bias gives geometric lengths of mean ~155-160 with ~4% at the
    # cap; 4 minutes on an H100 (2026-11-27), 2.5 of them warming up (compiles, untimed runs)
    limit=${REPORT_TIMEOUT:-560}
    run python3 benchmarks/engine_speed.py --preset=rho-1b --dtype=bfloat16 \
      --max_prompt_len=256 --max_new_tokens=512 --width=72 --samples_per_prompt=24 \
      --prompts=18 --repeats=2 --eos_bias=-0.5 "${@:2}"
    ;;
  reward_model)
    # the README's "Reward models on one GPU" plans, run: 64 pairs of 512 + 54 tokens (TL;DR),
    # float32 params and Adam state, bfloat16 compute; the 2.8B one without remat at 4
    # micro-batches (planned 106 GiB) is left out as it cannot fit
    rm="$G --skip=decode,score,train --pairs=64 --prompt=512 --new=54 --vocab=50304 --repeats=2"
    run $rm --shape=pythia-1b --microbatches=4
    run $rm --shape=pythia-2.8b --microbatches=8
    run $rm --shape=pythia-2.8b --microbatches=4 --remat=nothing_saveable
    ;;
  smoke_tldr|smoke_gsm8k)
    # sampler and learner share the device; each run gets most of a 10-minute command (the
    # GSM8K one had trained only its first step after 4 minutes on an H100)
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
    limit=${REPORT_TIMEOUT:-560}
    if [ "$part" = smoke_tldr ]; then
      run python3 benchmarks/paper_smoke.py --run=tldr_pythia_1b --steps=4 --timeout=$((limit - 10))
    else
      [ $# -ge 2 ] || usage "smoke_gsm8k needs a GSM8K folder (GSM8K_DIR)"
      gsm8k=$2
      run python3 benchmarks/paper_smoke.py --run=gsm8k_rho1b --gsm8k_dir="$gsm8k" --steps=4 \
        --timeout=$((limit - 10)) --set="${3:-}"
    fi
    ;;
  *)
    usage "unknown part '$part'"
    ;;
esac
