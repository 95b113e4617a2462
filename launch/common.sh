# Argument parsing and checks shared by launch/pretrain.sh and launch/torchrun.sh (sourced).
#
# Sets: repo, ds_config, config, hostfile, num_gpus, num_nodes, master_addr, master_port,
# launcher, dry_run, overrides (the run config overrides: everything that is not an option).

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
script="$(basename "$0")"

die() {
    echo "$script: error: $*" >&2
    exit 2
}

# The command, shell-quoted so it can be copied and pasted.
quote() {
    printf '%q' "$1"
    shift
    (($#)) && printf ' %q' "$@"
    echo
}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

available_ds() {
    (cd "$repo/ds_configs" && ls -- *.json | sed 's/\.json$//' | xargs)
}

parse_launch_args() {
    ds="" config="" hostfile="" num_gpus="" num_nodes="" master_addr="" master_port=29500 launcher="" dry_run=0
    overrides=()
    while (($#)); do
        case "$1" in
            --ds | --config | --hostfile | --num_gpus | --num_nodes | --master_addr | --master_port | --launcher)
                (($# >= 2)) || die "$1 needs a value"
                declare -g "${1#--}=$2"
                shift 2
                ;;
            --dry-run) dry_run=1; shift ;;
            -h | --help) usage; exit 0 ;;
            -*) die "unknown option $1 (see --help)" ;;
            *) overrides+=("$1"); shift ;;
        esac
    done
    [[ -n "$config" ]] || die "--config is required (a run config such as configs/quickstart.yaml)"
    [[ -f "$config" ]] || die "run config $config not found"
    [[ -n "$ds" ]] || die "--ds is required: one of $(available_ds)"
    ds_config="$repo/ds_configs/$ds.json"
    [[ -f "$ds_config" ]] || die "no DeepSpeed config $ds_config; choose one of: $(available_ds)"
    if [[ -n "$hostfile" && ! -f "$hostfile" ]]; then
        die "hostfile $hostfile not found (one line per node: 'hostname slots=NUM_GPUS')"
    fi
}
