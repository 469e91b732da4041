#!/usr/bin/env bash
# Train on a TPU pod slice: run the same command on every host of the slice.
# JAX discovers the slice itself (DSPARK_DISTRIBUTED=auto -> jax.distributed.initialize()).
#
#   TPU_NAME=my-v5p-64 ZONE=us-east5-a CONFIG=configs/dspark_qwen3_4b.py ./launch/tpu_pod.sh mesh=data=-1,fsdp=8
#
# Data, the target checkpoint, the feature cache and output_dir must be on storage every host
# can read (GCS via gcsfuse, Filestore, ...). Checkpoints are written by all hosts (orbax).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:?set CONFIG}"
REPO_DIR=${REPO_DIR:-~/dspark-jax}
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  cd $REPO_DIR && DSPARK_DISTRIBUTED=auto .venv/bin/dspark-jax train --config $CONFIG $*
"
