#!/usr/bin/env bash
# smelt-ds training job for the deepspeed launcher. Rendered by
#   smelt-ds render-job RECIPE --scheduler deepspeed [--hostfile HOSTFILE] [--nodes N --gpus-per-node G] -o run.sh
# which fills in the fields marked with double braces below; run the rendered script on the first host of the hostfile
# (or on the one machine when there is no hostfile).
#
# The deepspeed launcher reads the hostfile, reaches every host over passwordless ssh (pdsh when
# installed) and starts --num_gpus ranks on each of the first --num_nodes hosts, with RANK,
# LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set for smelt_ds.train. It forwards NCCL_*
# and PYTHON* variables to the other hosts by itself; the others listed below go through a
# DS_ENV_FILE. Stopped or crashed? Run the script again: `--resume auto` continues from the newest
# complete checkpoint.
#
# Stopping: the launcher does not pass SIGTERM on to the ranks of one host, and on several hosts
# it SIGKILLs them 30 s after SIGTERM, which can cut a checkpoint short. So this script runs the
# launcher in the background and, on SIGTERM, SIGINT or SIGHUP, creates RUN_DIR/STOP: the ranks on
# every host finish their step, save a checkpoint together and exit 143; the script waits for the
# launcher and exits with its status. `touch RUN_DIR/STOP` does the same from anywhere, during
# start-up too (a STOP left by an earlier run is removed before the launcher starts). The ranks
# on this host also stop (and save) when this script dies (SMELT_LAUNCHER_PID).
set -euo pipefail

# ---- filled in by smelt-ds render-job ------------------------------------------------------------
# the repository checkout (the same path on every host); the recipe, relative to it; the hostfile
# (empty: this machine only); the layout; the first host of the hostfile and the rendezvous port;
# more smelt_ds.train arguments (the layout's overrides and --set), shell-quoted; the run directory
# (train.run_dir or --run-dir, relative to the checkout unless absolute)
SMELT_WORKDIR={{WORKDIR}}
SMELT_RECIPE={{RECIPE}}
SMELT_HOSTFILE={{HOSTFILE}}
SMELT_NNODES={{NODES}}
SMELT_GPUS_PER_NODE={{GPUS_PER_NODE}}
SMELT_MASTER_ADDR={{MASTER_ADDR}}
SMELT_MASTER_PORT={{MASTER_PORT}}
SMELT_TRAIN_ARGS={{TRAIN_ARGS}}
SMELT_RUN_DIR={{RUN_DIR}}

# ---- network and runtime knobs: defaults here; export your own before running to override ----------
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# faults and hangs (docs/cluster.md, docs/faults.md): a failed or timed-out collective does not abort the
# rank (3, torch's default): on a collective timeout each rank dumps its last collectives (the flight
# recorder) into RUN_DIR/nccl_trace/, and the hang watchdog ends it with its stacks in RUN_DIR/hangs/ (124)
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$SMELT_RUN_DIR/nccl_trace/rank_}"
export TORCH_NCCL_ENABLE_MONITORING=${TORCH_NCCL_ENABLE_MONITORING:-1}
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-600}
# Set when your fabric needs them: NCCL_SOCKET_IFNAME (e.g. ib0), GLOO_SOCKET_IFNAME (the gloo control
# group: stop, step guard, metrics; e.g. eth0), NCCL_IB_HCA (e.g. mlx5_0,mlx5_1),
# NCCL_IB_DISABLE=1 (TCP only), NCCL_NET_GDR_LEVEL; SMELT_DS_CACHE (token cache, on a shared filesystem).
{{ENV_EXPORTS}}
# gloo (control group, in-loop harness) on NCCL_SOCKET_IFNAME's interfaces unless GLOO_SOCKET_IFNAME is set
{{GLOO_FROM_NCCL}}

cd "$SMELT_WORKDIR"
if ! command -v deepspeed >/dev/null 2>&1; then
  echo "smelt-ds: no deepspeed launcher on PATH on $(hostname): install smelt-ds with scripts/install_gpu.sh" \
    "(README, docs/cluster.md) and activate that environment before running this script" >&2
  exit 2
fi
mkdir -p "$(dirname "$TORCH_NCCL_DEBUG_INFO_TEMP_FILE")"  # the flight recorder writes into an existing directory
# the launcher reads KEY=VALUE lines for the other hosts from $DS_ENV_FILE (default .deepspeed_env) in
# the home directory and in the working directory; this script passes its own through a temporary
# DS_ENV_FILE, which starts with the lines of the user's files so that those still reach every host
user_env=${DS_ENV_FILE:-.deepspeed_env}
if [[ "$user_env" == /* ]]; then user_env_files=("$user_env"); else user_env_files=("$HOME/$user_env" "$PWD/$user_env"); fi
DS_ENV_FILE=$(mktemp)
export DS_ENV_FILE
trap 'rm -f "$DS_ENV_FILE"' EXIT
for f in "${user_env_files[@]}"; do
  if [[ -f "$f" ]]; then grep -v '^[[:space:]]*$' "$f" >> "$DS_ENV_FILE" || true; fi  # no blank line: the launcher splits each on =
done
for var in TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_NCCL_DUMP_ON_TIMEOUT TORCH_NCCL_TRACE_BUFFER_SIZE \
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE TORCH_NCCL_ENABLE_MONITORING TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC \
    OMP_NUM_THREADS SMELT_DS_CACHE GLOO_SOCKET_IFNAME HF_HOME HF_HUB_OFFLINE FI_PROVIDER FI_EFA_USE_DEVICE_RDMA {{ENV_NAMES}}; do
  if [[ -n "${!var:-}" ]]; then echo "$var=${!var}" >> "$DS_ENV_FILE"; fi
done
launcher=(deepspeed --num_nodes "$SMELT_NNODES" --num_gpus "$SMELT_GPUS_PER_NODE"
          --master_addr "$SMELT_MASTER_ADDR" --master_port "$SMELT_MASTER_PORT")
if [[ -n "$SMELT_HOSTFILE" ]]; then launcher+=(--hostfile "$SMELT_HOSTFILE"); fi
eval "train_args=($SMELT_TRAIN_ARGS)"
echo "smelt-ds: ${launcher[*]} --module smelt_ds.train $SMELT_RECIPE --resume auto ${train_args[*]}" >&2

# ---- stop: SIGTERM / SIGINT / SIGHUP -> RUN_DIR/STOP -> every rank saves a checkpoint and exits 143 ----
# A STOP left by an earlier run is not for this one: remove it before the launcher starts. From here on any
# STOP (this script's, or a `touch`), even one written while the ranks start, stops them at their next step.
if [[ -e "$SMELT_RUN_DIR/STOP" ]]; then
  rm -f "$SMELT_RUN_DIR/STOP"
  echo "smelt-ds: removed $SMELT_RUN_DIR/STOP left by an earlier run" >&2
fi
got_signal=0
stop_ranks() {  # the file holds a nonce (rank 0 tells it from a STOP it already honoured), written whole by a rename
  got_signal=1
  mkdir -p "$SMELT_RUN_DIR" &&
    echo "$(cat /proc/sys/kernel/random/uuid 2>/dev/null || echo "$RANDOM$RANDOM$RANDOM") $1 to pid $$ on" \
      "$(hostname)" > "$SMELT_RUN_DIR/.STOP.$$" && mv -f "$SMELT_RUN_DIR/.STOP.$$" "$SMELT_RUN_DIR/STOP"
  echo "smelt-ds: $1: created $SMELT_RUN_DIR/STOP: the ranks finish their step, save a checkpoint and exit;" \
    "waiting for the launcher" >&2
}
trap 'stop_ranks SIGTERM' TERM
trap 'stop_ranks SIGINT' INT
trap 'stop_ranks SIGHUP' HUP
export SMELT_LAUNCHER_PID=$$  # the ranks on this host stop (and save) when this script dies
"${launcher[@]}" --module smelt_ds.train "$SMELT_RECIPE" --resume auto "${train_args[@]}" &
launcher_pid=$!
rc=
while :; do  # a trapped signal ends `wait` early (status > 128): wait again until the launcher has exited
  got_signal=0
  wait "$launcher_pid" && status=0 || status=$?
  if (( status == 127 )) && [[ -n "$rc" ]]; then break; fi  # the launcher's status was already collected
  rc=$status
  (( got_signal )) || break
done
exit "$rc"
