#!/usr/bin/env bash
# A single-node Slurm for ckrun's tests and for trying ckrun on one machine.
#
#   slurm/dev-cluster.sh install   # apt-get install slurm-wlm munge (Debian; 22.05 on bookworm)
#   slurm/dev-cluster.sh start     # write the config, start munged, slurmctld, slurmd; wait for idle
#   slurm/dev-cluster.sh status    # daemons, sinfo, the settings ckrun relies on
#   slurm/dev-cluster.sh stop      # kill the daemons (jobs die with them); config and state stay
#   slurm/dev-cluster.sh env       # print `export SLURM_CONF=...` for client commands
#
# Runs as root, without systemd: the daemons are started by hand and found again through
# their pid files, so every subcommand is idempotent (install twice, start twice, stop twice).
#
# Everything lives under $CKRUN_SLURM_DIR (default /var/tmp/ckrun-slurm): etc/slurm.conf,
# etc/cgroup.conf, state/, spool/, log/, run/.  Client commands find the config through
# SLURM_CONF; when /etc/slurm/slurm.conf is absent (or is already our link) the script also
# links it there so that plain `sbatch`/`sinfo`, and jobs that call `scontrol`, need no
# environment at all.
#
# Settings (issue 4; DESIGN.md §6 has what was measured with them):
#   ProctrackType=proctrack/linuxproc, TaskPlugin=task/none   no cgroups needed (containers)
#   NodeAddr=127.0.0.1, SlurmdParameters=config_overrides     advertise more CPUs than exist
#   JobRequeue=1                                              batch jobs requeue by default
#   AuthInfo=cred_expire=10                                   a requeued job restarts after ~11 s
#   SchedulerParameters=sched_interval=2                      the main scheduler runs every 2 s
#   partitions low (PriorityTier=1) and high (PriorityTier=10), PreemptType=preempt/partition_prio,
#   PreemptMode=REQUEUE, GraceTime=15 on low; KillWait=5.
# Tunables: CKRUN_SLURM_DIR, CKRUN_SLURM_CPUS (advertised CPUs, default 16),
#           CKRUN_SLURM_START_TIMEOUT_S (default 60).
set -euo pipefail

DIR="${CKRUN_SLURM_DIR:-/var/tmp/ckrun-slurm}"
CPUS="${CKRUN_SLURM_CPUS:-16}"
START_TIMEOUT_S="${CKRUN_SLURM_START_TIMEOUT_S:-60}"
CONF="$DIR/etc/slurm.conf"
NODE="$(hostname -s)"
MUNGE_SOCKET_DIR=/run/munge

log() { printf '[dev-cluster] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() {
    [ "$(id -u)" = 0 ] || die "run as root (the daemons run as root here: SlurmUser=root)"
}

cmd_install() {
    need_root
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v munged >/dev/null && command -v sbatch >/dev/null; then
        log "slurm-wlm and munge already installed: $(slurmctld -V)"
        return 0
    fi
    command -v apt-get >/dev/null || die "apt-get not found: install slurm-wlm and munge with your package manager"
    log "apt-get install slurm-wlm munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # policy-rc.d 101: the packages' postinst must not try to start services (no systemd here).
    local prc=/usr/sbin/policy-rc.d created=0
    if [ ! -e "$prc" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$prc"; chmod +x "$prc"; created=1
    fi
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
    [ "$created" = 1 ] && rm -f "$prc"
    log "installed: $(slurmctld -V)"
}

write_config() {
    mkdir -p "$DIR"/{etc,state,spool,log,run}
    local tmp="$CONF.tmp.$$"
    cat >"$tmp" <<EOF
# Written by slurm/dev-cluster.sh; rewritten on every start.
ClusterName=ckrun-dev
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET_DIR/munge.socket.2,cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
InactiveLimit=0
MinJobAge=300
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=4096 State=UNKNOWN
PartitionName=low Nodes=$NODE Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=15
PartitionName=high Nodes=$NODE Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
    mv "$tmp" "$CONF"
    # Not read with TaskPlugin=task/none and proctrack/linuxproc; written so that nothing
    # falls back to a system-wide cgroup.conf.
    printf '# Written by slurm/dev-cluster.sh; no cgroup plugin is in use.\nCgroupPlugin=autodetect\n' \
        >"$DIR/etc/cgroup.conf"
    if [ -L /etc/slurm/slurm.conf ] || [ ! -e /etc/slurm/slurm.conf ]; then
        mkdir -p /etc/slurm
        ln -sfn "$CONF" /etc/slurm/slurm.conf
    else
        log "/etc/slurm/slurm.conf exists and is not ours: export SLURM_CONF=$CONF for client commands"
    fi
}

# pid_alive PIDFILE: true when the pid file names a live process.
pid_alive() {
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_munge() {
    local pidf="$DIR/run/munged.pid"
    if pid_alive "$pidf"; then return 0; fi
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then mungekey --create --force; else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    fi
    chown root:root /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p "$MUNGE_SOCKET_DIR" /var/lib/munge /var/log/munge
    chown root:root "$MUNGE_SOCKET_DIR" /var/lib/munge /var/log/munge
    chmod 755 "$MUNGE_SOCKET_DIR"
    # --force: run as root and reuse a stale socket left by a killed munged.
    munged --force --socket="$MUNGE_SOCKET_DIR/munge.socket.2" --pid-file="$pidf" \
        --log-file="$DIR/log/munged.log"
    munge -n -S "$MUNGE_SOCKET_DIR/munge.socket.2" | unmunge -S "$MUNGE_SOCKET_DIR/munge.socket.2" >/dev/null \
        || die "munge does not work: see $DIR/log/munged.log"
}

node_state() {
    SLURM_CONF="$CONF" sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n1
}

cmd_start() {
    need_root
    command -v slurmctld >/dev/null || die "slurm is not installed: run '$0 install' first"
    write_config
    start_munge
    export SLURM_CONF="$CONF"
    pid_alive "$DIR/run/slurmctld.pid" || slurmctld -f "$CONF"
    pid_alive "$DIR/run/slurmd.pid" || slurmd -f "$CONF"
    local deadline=$((SECONDS + START_TIMEOUT_S)) state="" resumed=0
    while :; do
        state="$(node_state || true)"
        case "$state" in
            idle|mixed|allocated|completing) break ;;
            down*|drain*|fail*)
                if [ "$resumed" = 0 ]; then
                    scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
                    resumed=1
                fi ;;
        esac
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "node $NODE is '${state:-unknown}' after ${START_TIMEOUT_S}s; last log lines:"
            tail -n 20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
            exit 1
        fi
        sleep 0.5
    done
    log "up: node $NODE is $state (SLURM_CONF=$CONF)"
}

kill_pidfile() {
    local pidf="$1" name="$2" pid i
    pid_alive "$pidf" || { rm -f "$pidf"; return 0; }
    pid="$(cat "$pidf")"
    kill "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name ($pid) still alive after 5 s: SIGKILL"
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidf"
}

cmd_stop() {
    need_root
    kill_pidfile "$DIR/run/slurmd.pid" slurmd
    kill_pidfile "$DIR/run/slurmctld.pid" slurmctld
    kill_pidfile "$DIR/run/munged.pid" munged
    log "stopped"
}

cmd_status() {
    local name rc=0
    for name in munged slurmctld slurmd; do
        if pid_alive "$DIR/run/$name.pid"; then
            printf '%-10s running (pid %s)\n' "$name" "$(cat "$DIR/run/$name.pid")"
        else
            printf '%-10s stopped\n' "$name"; rc=3
        fi
    done
    if [ "$rc" = 0 ]; then
        export SLURM_CONF="$CONF"
        sinfo
        scontrol show config | grep -E '^(JobRequeue|KillWait|PreemptMode|PreemptType|SlurmctldParameters|AuthInfo|SchedulerParameters) '
    fi
    return "$rc"
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 install|start|stop|status|env" >&2; exit 2 ;;
esac
