#!/bin/bash
# Slurm TaskProlog: every task of every job starts with the mfuwatch bootstrap in its environment
# (slurm.conf: TaskProlog=/etc/slurm/mfuwatch-task-prolog.sh). Slurm reads the task's environment
# changes from this script's stdout ("export NAME=value" lines); see slurm.conf(5), TaskProlog.
#
# Per-job opt-out: sbatch --export=ALL,MFUWATCH_DISABLE=1 ... (or export MFUWATCH_DISABLE=1 before srun).
# Needs mfuwatch installed in the Python the jobs run (the bootstrap imports it once torch is imported;
# a Python without it prints one line and runs the job unmonitored).
MFUWATCH=${MFUWATCH:-/opt/mfuwatch/bin/mfuwatch}          # the site's mfuwatch command
CONFIG=${MFUWATCH_SITE_CONFIG:-/etc/mfuwatch/agent.yaml}  # e.g. file_sd_dir, timeline: /scratch/$USER/mfuwatch-{rank}.jsonl

case "${MFUWATCH_DISABLE:-}" in 1|true|yes|on) exit 0 ;; esac
[ -x "$MFUWATCH" ] || exit 0
# `--print-env` prints shell-quoted lines (for eval); Slurm takes the text after '=' literally, so they are
# evaluated here and printed again unquoted. A bad config: one line on stderr, the job runs unmonitored.
if [ -r "$CONFIG" ]; then
  lines=$("$MFUWATCH" run --config "$CONFIG" --print-env) || exit 0
else
  lines=$("$MFUWATCH" run --print-env) || exit 0
fi
eval "$lines"
echo "export PYTHONPATH=$PYTHONPATH"                   # the bootstrap first, the task's own entries after it
if [ -n "${MFUWATCH_CONFIG:-}" ]; then
  echo "export MFUWATCH_CONFIG=$MFUWATCH_CONFIG"
fi
echo "export MFUWATCH_JOB=slurm-${SLURM_JOB_ID:-0}"    # one `job` label for every rank of the job
exit 0                                                 # a TaskProlog's non-zero status would stop the task
