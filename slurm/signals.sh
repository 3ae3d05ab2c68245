# Sourced by slurm/ray_job.sh: run the driver with the batch shell's signals forwarded to it, and requeue
# the job after a preemption's checkpoint.
#
#   source slurm/signals.sh
#   run_forwarding_signals python -m megarl.run.train ...   # sets DRIVER_RC and FORWARDED
#   requeue_if_preempted                                    # last, after the teardown
#
# Slurm's warning (`#SBATCH --signal=B:USR1@<secs>`, and at preemption with the cluster's
# PreemptParameters=send_user_signal) goes to the batch shell only (B:). A shell waiting for a
# foreground command runs its traps only after the command ends (and USR1 without a trap would kill
# it), so the driver runs in the background and this shell waits for it, forwarding SIGUSR1, SIGTERM
# and SIGINT: the driver saves the step in progress when it ends and exits with 128 + the signal
# (trainer.save_on_preempt). A SIGTERM that Slurm sends to every process of the job reaches the driver
# twice within its 1 s duplicate window, which counts as one. When the driver stopped for the forwarded
# warning (USR1, exit 138), `requeue_if_preempted` puts the job back in the queue (`scontrol requeue`; the
# launchers set `#SBATCH --requeue`) and the requeued job resumes from that checkpoint
# (trainer.resume_mode=auto). A SIGTERM is not requeued here: it is scancel's (the user meant it), or a
# preemption that Slurm requeues by itself (PreemptMode=REQUEUE). MEGARL_REQUEUE=0 turns the requeue off.
# The caller sets its own traps again after `run_forwarding_signals`.

DRIVER_RC=0
FORWARDED=""

run_forwarding_signals() {
    "$@" &
    local driver=$!
    trap 'FORWARDED=${FORWARDED:-USR1}; kill -USR1 '"$driver"' 2>/dev/null' USR1
    trap 'FORWARDED=${FORWARDED:-TERM}; kill -TERM '"$driver"' 2>/dev/null' TERM
    trap 'FORWARDED=${FORWARDED:-INT}; kill -INT '"$driver"' 2>/dev/null' INT
    # `wait` also returns when a trapped signal arrives (with 128 + the signal): wait again until the driver is
    # gone; bash keeps the status of a child it reaped, so the last `wait` returns the driver's own
    while kill -0 "$driver" 2>/dev/null; do
        wait "$driver"
    done
    wait "$driver"
    DRIVER_RC=$?
}

requeue_if_preempted() {
    if [ "$FORWARDED" = USR1 ] && [ "$DRIVER_RC" = 138 ] && [ "${MEGARL_REQUEUE:-1}" != 0 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
        echo "[ray_job $(date +%H:%M:%S)] the driver stopped for Slurm's warning (SIGUSR1): requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" || echo "[ray_job] scontrol requeue $SLURM_JOB_ID failed: resubmit the job; it resumes from its checkpoint" >&2
    fi
}
