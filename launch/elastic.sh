#!/usr/bin/env bash
# Elastic pretraining: torchrun's elastic agent, one per node, with a c10d rendezvous. Nodes may
# leave (a failure) and join (a replacement) while the run goes on: each change restarts every
# worker, which resumes from the newest complete checkpoint on the new number of nodes (the
# checkpoint is converted when the layout changed; packed data continues at the saved sample).
#
#   On every node (the same command; nodes may start late, stop and come back):
#     launch/elastic.sh --ds zero2 --config configs/NAME.yaml --master_addr 10.0.0.1 \
#       --min_nodes 1 --max_nodes 4 --num_gpus 8
#   --min_nodes / --max_nodes   the run trains with any number of nodes in this range (default 1:2)
#   --max_restarts              worker-group restarts after failures before giving up (default 100);
#                               nodes joining restart the workers without counting
#   --rdzv_conf                 torchrun's rendezvous options, e.g. last_call_timeout=5
#   --num_gpus defaults to all GPUs of the node; --master_addr to localhost.
#   Run config overrides go at the end:   ... train.save_interval=100
#   --dry-run prints the command and runs nothing.
# Checkpoint often (train.save_interval or train.save_interval_minutes): a restart loses the
# steps since the last one. The data must be packed shards (data.train): a streaming mixture
# resumes only on its own number of data-parallel ranks.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

min_nodes=1 max_nodes=2 max_restarts=100 rdzv_conf=""
rest=()
while (($#)); do
    case "$1" in
        --min_nodes | --max_nodes | --max_restarts | --rdzv_conf)
            (($# >= 2)) || die "$1 needs a value"
            declare "${1#--}=$2"
            shift 2
            ;;
        *) rest+=("$1"); shift ;;
    esac
done
parse_launch_args "${rest[@]}"
[[ -z "$launcher$hostfile$num_nodes" ]] || die "--launcher, --hostfile and --num_nodes do not apply: start this script on every node"
((min_nodes >= 1 && min_nodes <= max_nodes)) || die "--min_nodes $min_nodes must be between 1 and --max_nodes $max_nodes"

# torch 2.13's agents share the rendezvous TCP store with the workers; then an agent that was rank
# 0 of the previous round does not publish the workers' master address for the next one, and a
# node joining a running job waits for it until it times out. Without sharing, each round does.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
# ${PYTHON:-python} -m torch.distributed.run is torchrun, from the interpreter that runs llmstack.
cmd=("${PYTHON:-python}" -m torch.distributed.run --nnodes "$min_nodes:$max_nodes" --nproc_per_node "${num_gpus:-gpu}"
    --rdzv_backend c10d --rdzv_endpoint "${master_addr:-localhost}:$master_port" --rdzv_id llmstack-elastic
    --max_restarts "$max_restarts")
[[ -z "$rdzv_conf" ]] || cmd+=(--rdzv_conf "$rdzv_conf")
cmd+=(-m llmstack train --config "$config" --ds-config "$ds_config" --resume auto "${overrides[@]}")

quote "${cmd[@]}"
((dry_run)) && exit 0
exec "${cmd[@]}"
