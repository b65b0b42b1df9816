"""End-to-end check of the local Slurm started by start.sh (run as root, with the venv's python).

usage: python scripts/slurm/selftest.py ROOT

Starts the cluster under ROOT (start.sh), then checks: (a) an sbatch job, (b) a 2-task
submitit job returning a value, (c) a cancelled submitit job raising UncompletedJobError,
(d) `scontrol requeue` restarting a --requeue job, (e) two 2-task jobs running at once.
Stops the cluster (stop.sh) and checks that no daemon is left. Prints the timings.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def sh(*cmd: str, **kw) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout.strip()


def wait(what: str, cond, timeout: float, step: float = 0.1):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise TimeoutError(f"timed out after {timeout}s: {what}")


def state(job: str) -> str:
    return sh("squeue", "-h", "-j", job, "-o", "%T") if job else ""


def sacct_state(job: str) -> str:
    out = sh("sacct", "-n", "-X", "-P", "-j", job, "-o", "State")
    return out.splitlines()[-1] if out else ""


def hello(x: int) -> tuple[int, int]:
    import submitit

    env = submitit.JobEnvironment()
    return env.global_rank, x * 2


def sleeper(t: float) -> str:
    time.sleep(t)
    return "done"


def main() -> None:
    root = Path(sys.argv[1]).resolve()
    figures: dict[str, str] = {}
    t = time.time()
    subprocess.run(["bash", str(HERE / "start.sh"), str(root)], check=True)
    figures["start to idle"] = f"{time.time() - t:.1f} s"
    os.environ["SLURM_CONF"] = str(root / "etc/slurm.conf")
    partition = "debug"
    work = root / "selftest"
    work.mkdir(exist_ok=True)
    signal.alarm(300)  # a hang anywhere fails the selftest instead of blocking it
    try:
        import submitit

        # (a) sbatch
        out = work / "a.out"
        t = time.time()
        jid = sh("sbatch", "--parsable", "-p", partition, "-o", str(out),
                 "--wrap", "python3 -c 'import time; print(time.time())'; srun -n1 hostname")
        wait("sbatch job to finish", lambda: state(jid) == "", 30)
        lines = out.read_text().split()
        figures["(a) sbatch submit-to-start"] = f"{float(lines[0]) - t:.2f} s"
        assert wait("sacct COMPLETED", lambda: sacct_state(jid) == "COMPLETED", 10), sacct_state(jid)
        print(f"(a) sbatch job {jid} COMPLETED, output {lines}")

        # (b) submitit, 2 tasks, returns a value
        ex = submitit.AutoExecutor(folder=work / "submitit/%j", cluster="slurm")
        ex.update_parameters(timeout_min=5, slurm_partition=partition, nodes=1, tasks_per_node=2,
                             cpus_per_task=1)
        t = time.time()
        job = ex.submit(hello, 21)
        res = job.results()
        figures["(b) submitit 2-task submit-to-result"] = f"{time.time() - t:.1f} s"
        assert sorted(res) == [(0, 42), (1, 42)], res
        print(f"(b) submitit job {job.job_id}: results {res}")

        # (c) scancel -> UncompletedJobError, not a hang
        ex.update_parameters(tasks_per_node=1)
        job = ex.submit(sleeper, 600)
        wait("submitit sleeper running", lambda: state(job.job_id) == "RUNNING", 30)
        t = time.time()
        sh("scancel", job.job_id)
        try:
            job.result()
        except submitit.core.utils.UncompletedJobError as e:
            figures["(c) scancel -> UncompletedJobError"] = f"{time.time() - t:.1f} s"
            print(f"(c) cancelled job {job.job_id} raised UncompletedJobError: {str(e).splitlines()[0]}")
        else:
            raise AssertionError("cancelled job returned a result")

        # (d) scontrol requeue of a running --requeue job
        marker = work / "d.starts"
        script = work / "d.sh"
        script.write_text(f"#!/bin/bash\necho \"$SLURM_RESTART_COUNT $(date +%s.%N)\" >> {marker}\nsleep 300\n")
        jid = sh("sbatch", "--parsable", "--requeue", "-p", partition, "-o", str(work / "d.out"), str(script))
        wait("requeue job running", lambda: marker.exists() and state(jid) == "RUNNING", 30)
        t = time.time()
        sh("scontrol", "requeue", jid)
        wait("requeued job restarted", lambda: marker.exists() and len(marker.read_text().splitlines()) >= 2, 60)
        starts = marker.read_text().splitlines()
        figures["(d) requeue -> restarted"] = f"{float(starts[1].split()[1]) - t:.1f} s"
        print(f"(d) job {jid} restarted, starts (restart count, time): {starts}")
        sh("scancel", jid)

        # (e) two 2-task jobs at once
        script = work / "e.sh"
        script.write_text("#!/bin/bash\nsrun bash -c 'echo $SLURM_PROCID $(date +%s.%N)'\nsleep 8\n")
        ids = [sh("sbatch", "--parsable", "-p", partition, "-n", "2", "-c", "1",
                  "-o", str(work / f"e{i}.out"), str(script)) for i in range(2)]
        wait("both 2-task jobs running at once",
             lambda: all(state(j) == "RUNNING" for j in ids), 20)
        print(f"(e) jobs {ids} RUNNING concurrently:\n" + sh("squeue", "-o", "%.10i %.9P %.8T %.5D %.4C %R"))
        wait("2-task jobs done", lambda: all(state(j) == "" for j in ids), 30)
        for j in ids:
            assert sacct_state(j) == "COMPLETED", (j, sacct_state(j))
    finally:
        signal.alarm(0)
        subprocess.run(["bash", str(HERE / "stop.sh"), str(root)], check=True)
    # nothing left: none of the recorded pids alive
    left = []
    for name in ["munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "slurmstepd"]:
        for p in Path("/proc").glob("[0-9]*"):
            try:
                if (p / "comm").read_text().strip() == name and \
                        (p / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and \
                        f"{root}".encode() in (p / "cmdline").read_bytes() + (p / "environ").read_bytes():
                    left.append(f"{name}:{p.name}")
            except OSError:
                pass
    assert not left, f"daemons left after stop.sh: {left}"
    print("no daemon left after stop.sh")
    print("\nfigures:")
    for k, v in figures.items():
        print(f"  {k}: {v}")
    print("selftest: all checks passed")


if __name__ == "__main__":
    main()
