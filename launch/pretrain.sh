#!/usr/bin/env bash
# Pretrain with the DeepSpeed launcher, picking a DeepSpeed config from ds_configs/ by name.
#
#   Single node, all GPUs:
#     launch/pretrain.sh --ds zero2 --config configs/quickstart.yaml
#   Single node, 2 ranks (on a machine without GPUs they run on CPU):
#     launch/pretrain.sh --ds zero2 --config configs/quickstart.yaml --num_gpus 2
#   Multi-node, from node 0 (passwordless ssh to every host; hostfile lines "hostname slots=N";
#   without --master_addr DeepSpeed asks the first host for its address):
#     launch/pretrain.sh --ds zero3_offload --config configs/NAME.yaml \
#       --hostfile hostfile --num_nodes 2 --num_gpus 8 --master_addr 10.0.0.1
#   --launcher pdsh|openmpi|slurm|... picks DeepSpeed's multi-node backend (default pdsh).
#   Run config overrides go at the end:   ... train.lr=3e-4 train.max_steps=2000
#   --dry-run prints the command and runs nothing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_launch_args "$@"
if [[ -z "$hostfile" && -n "$num_nodes" && "$num_nodes" != 1 ]]; then
    die "--num_nodes $num_nodes needs --hostfile listing the nodes"
fi

cmd=(deepspeed)
[[ -n "$hostfile" ]] && cmd+=(--hostfile "$hostfile")
[[ -n "$num_nodes" ]] && cmd+=(--num_nodes "$num_nodes")
[[ -n "$num_gpus" ]] && cmd+=(--num_gpus "$num_gpus")
[[ -n "$launcher" ]] && cmd+=(--launcher "$launcher")
[[ -n "$master_addr" ]] && cmd+=(--master_addr "$master_addr")
cmd+=(--master_port "$master_port")
# `llmstack train` reads LOCAL_RANK from the environment instead of a --local_rank argument.
cmd+=(--no_local_rank --module llmstack train --config "$config" --ds-config "$ds_config" "${overrides[@]}")

quote "${cmd[@]}"
((dry_run)) && exit 0
exec "${cmd[@]}"
