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
set -euo pipefail

# ---- filled in by smelt-ds render-job ------------------------------------------------------------
# the repository checkout (the same path on every host); the recipe, relative to it; the hostfile
# (empty: this machine only); the layout; the first host of the hostfile and the rendezvous port;
# more smelt_ds.train arguments (the layout's overrides and --set), shell-quoted
SMELT_WORKDIR={{WORKDIR}}
SMELT_RECIPE={{RECIPE}}
SMELT_HOSTFILE={{HOSTFILE}}
SMELT_NNODES={{NODES}}
SMELT_GPUS_PER_NODE={{GPUS_PER_NODE}}
SMELT_MASTER_ADDR={{MASTER_ADDR}}
SMELT_MASTER_PORT={{MASTER_PORT}}
SMELT_TRAIN_ARGS={{TRAIN_ARGS}}

# ---- network and runtime knobs: defaults here; export your own before running to override ----------
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# Set when your fabric needs them: NCCL_SOCKET_IFNAME (e.g. ib0), NCCL_IB_HCA (e.g. mlx5_0,mlx5_1),
# NCCL_IB_DISABLE=1 (TCP only), NCCL_NET_GDR_LEVEL; SMELT_DS_CACHE (token cache, on a shared filesystem).
{{ENV_EXPORTS}}

cd "$SMELT_WORKDIR"
DS_ENV_FILE=$(mktemp)
export DS_ENV_FILE
trap 'rm -f "$DS_ENV_FILE"' EXIT
for var in TORCH_NCCL_ASYNC_ERROR_HANDLING OMP_NUM_THREADS SMELT_DS_CACHE HF_HOME HF_HUB_OFFLINE FI_PROVIDER \
    FI_EFA_USE_DEVICE_RDMA {{ENV_NAMES}}; do
  if [[ -n "${!var:-}" ]]; then echo "$var=${!var}" >> "$DS_ENV_FILE"; fi
done
launcher=(deepspeed --num_nodes "$SMELT_NNODES" --num_gpus "$SMELT_GPUS_PER_NODE"
          --master_addr "$SMELT_MASTER_ADDR" --master_port "$SMELT_MASTER_PORT")
if [[ -n "$SMELT_HOSTFILE" ]]; then launcher+=(--hostfile "$SMELT_HOSTFILE"); fi
eval "train_args=($SMELT_TRAIN_ARGS)"
echo "smelt-ds: ${launcher[*]} --module smelt_ds.train $SMELT_RECIPE --resume auto ${train_args[*]}" >&2
"${launcher[@]}" --module smelt_ds.train "$SMELT_RECIPE" --resume auto "${train_args[@]}"
