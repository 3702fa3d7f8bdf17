"""The generic actor runtime: a supervised, staged pipeline over shared memory.

Nothing here knows about DFlash, models or batches of tokens (``tests/unit/
test_runtime_generic.py`` fails if it ever imports them): it moves integer batch ids
through stages of actor processes, with the data in preallocated shared-memory rings.

    config      RuntimeConfig, and the validated-dataclass machinery every config uses
    messages    everything that crosses a pipe (Work, Stop, Ready, Done, Note, Starting,
                ActorError), and ProtocolError: a message that contradicts the ledger
    ledger      the shared table of every batch's state: the commit points
    channels    rings of typed tensor slots: the data plane
    dispatch    Stage and Dispatcher: routing, slot reservation, recovery from the ledger
    actor       the actor process: lifecycle, heartbeats, the one error handler
    boot        an actor's first code: the parent-death signal, armed before any import
    forker      the fork server's first import (start_method forkserver): it dies with us
    forking     the fork server: one process that imports torch once and forks every actor
    events      events.log, one writer and one schema
    files       write-then-rename: how every shared file and directory is replaced
    trace       where each actor spent its time: spans merged into trace.json
    policy      what a death means: restart, give up, or raise to the caller
    children    the supervisor's record of each actor (its process, pipe, start-up phase,
                a gang's ranks)
    group       the actors' processes: start, read, signal, stop; gangs; a lost fork server
    health      hung (killed) and stuck (shown) actors, from heartbeats and start-up progress
    status      the runtime's block of status.json
    faults      runtime.faults checked against the actors; faults aimed at the supervisor
    wakeup      what wakes the supervisor's loop: SIGINT/SIGTERM and other threads
    outcome     how a run ended: JobState, JobResult (reason, exit code, commits, restarts)
    supervisor  the loop and its decisions over the group: restart, give up, raise or stop
"""
