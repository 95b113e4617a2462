#!/usr/bin/env bash
# Pretrain with torchrun instead of the DeepSpeed launcher (same trainer, same ds_configs/).
#
#   Single node:
#     launch/torchrun.sh --ds zero2 --config configs/quickstart.yaml --num_gpus 2
#   Multi-node, one command per node (run it on every node; c10d rendezvous at --master_addr):
#     launch/torchrun.sh --ds zero3 --config configs/NAME.yaml --num_nodes 2 --num_gpus 8 \
#       --master_addr 10.0.0.1
#   Multi-node from one machine: with --hostfile (lines "hostname slots=N") the script starts
#   that command on every host over ssh; --num_nodes defaults to the number of hosts and
#   --master_addr to the first host.
#   --num_gpus defaults to all GPUs of the node.
#   Run config overrides go at the end:   ... train.lr=3e-4 train.max_steps=2000
#   --dry-run prints the command(s) and runs nothing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_launch_args "$@"
[[ -z "$launcher" ]] || die "--launcher is an option of launch/pretrain.sh; torchrun has its own"

hosts=()
if [[ -n "$hostfile" ]]; then
    mapfile -t hosts < <(sed 's/#.*//' "$hostfile" | awk 'NF {print $1}')
    ((${#hosts[@]})) || die "hostfile $hostfile lists no hosts"
    num_nodes="${num_nodes:-${#hosts[@]}}"
    ((num_nodes <= ${#hosts[@]})) || die "--num_nodes $num_nodes but $hostfile lists ${#hosts[@]} host(s)"
    hosts=("${hosts[@]:0:num_nodes}")
    master_addr="${master_addr:-${hosts[0]}}"
fi

cmd=(torchrun --nproc_per_node "${num_gpus:-gpu}")
if ((${num_nodes:-1} == 1)); then
    cmd+=(--standalone)
else
    [[ -n "$master_addr" ]] || die "--num_nodes $num_nodes needs --master_addr (or a --hostfile)"
    cmd+=(--nnodes "$num_nodes" --rdzv_backend c10d --rdzv_endpoint "$master_addr:$master_port" --rdzv_id llmstack)
fi
cmd+=(-m llmstack train --config "$config" --ds-config "$ds_config" "${overrides[@]}")

if ((${#hosts[@]} == 0)); then
    quote "${cmd[@]}"
    ((dry_run)) && exit 0
    exec "${cmd[@]}"
fi

# The same command on every host, from the same directory; the rendezvous assigns node ranks.
remote="cd $(printf '%q' "$PWD") && $(quote "${cmd[@]}")"
pids=()
for host in "${hosts[@]}"; do
    echo "ssh $(printf '%q' "$host") ${remote@Q}"
    ((dry_run)) || { ssh "$host" "$remote" & pids+=($!); }
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit "$status"
