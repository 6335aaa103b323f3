"""A trial on pytorch/examples' mnist_hogwild: two processes train one shared model.

``mnist_hogwild/main.py`` puts a CNN in shared memory and starts two processes (``spawn``)
that each run ``train.py``'s loop on it with their own SGD optimizer. A user attaching
gradwatch writes ``watch(model, optimizer)`` inside ``train()``, in each process:

* ``naive``: as README's quickstart reads for one process, no ``rank=``: both processes
  report as rank 0 of one job. The collector must say so (collector/twins.py) rather
  than merge two runs into one silently;
* ``ranked``: ``watch(..., rank=rank, world=2)``, each process its own rank.

torchvision is not installed here: ``benchmarks/standins/`` gives its MNIST (synthetic
digits). One epoch each. Healthy both: every warning-or-higher alert is a false page;
the table also says whether the collector logged the two agents of one rank.

    git --git-dir=$(fetch pytorch/examples) archive HEAD mnist_hogwild | tar -x -C /tmp/pex2
    python benchmarks/hogwild_trial.py /tmp/pex2/mnist_hogwild --keep /tmp/trials/hog1
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from trials import STANDINS, insert_after, report, run_recorded, trial_args

VARIANTS: dict[str, tuple[str, ...]] = {"naive": (), "ranked": ()}
TWINS = "is reported by two live agents"


def patch(text: str, job: str, endpoint: str, ranked: bool) -> str:
    """train.py with gradwatch attached in ``train()``, which each process runs."""
    rank = ", rank=rank, world=args.num_processes" if ranked else ""
    opt = "    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)\n"
    t = insert_after(
        text,
        opt,
        "    global MON\n    import gradwatch\n"
        f"    MON = gradwatch.watch(model, optimizer, job={job!r}, endpoint={endpoint!r}{rank})\n",
        "train.py",
    )
    epochs = "        train_epoch(epoch, args, model, device, train_loader, optimizer)\n"
    t = insert_after(t, epochs, "    MON.close()\n", "train.py")
    step = "        optimizer.step()\n"
    return insert_after(t, step, "        MON.log(loss=loss)\n", "train.py")


def main(argv: list[str] | None = None) -> int:
    p, args, chosen = trial_args(__doc__ or "", "checkout", VARIANTS, 1, argv)
    traces = args.replay_only
    if traces is None:
        root = args.checkout
        if root is None or not (root / "train.py").exists():
            p.error("give pytorch/examples' mnist_hogwild folder, or --replay-only")
        work = Path(tempfile.mkdtemp(prefix="hogwild-trial-"))
        traces = args.keep or work / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        for variant in chosen:
            run_dir = work / variant  # its own collector.log
            vdir = run_dir / "script"
            vdir.mkdir(parents=True)
            shutil.copy(root / "main.py", vdir / "main.py")

            def write(endpoint: str, variant: str = variant, vdir: Path = vdir) -> list[str]:
                text = patch(
                    (root / "train.py").read_text(encoding="utf8"),
                    f"hogwild-{variant}",
                    endpoint,
                    ranked=variant == "ranked",
                )
                (vdir / "train.py").write_text(text)
                return ["main.py", "--epochs", str(args.iters)]

            env = {"PYTHONPATH": str(STANDINS)}
            run_recorded(run_dir, traces, f"hogwild-{variant}", vdir, write, env)
            log = (run_dir / "collector.log").read_text(encoding="utf8", errors="replace")
            print(f"[{variant}] collector logged two agents as one rank: {TWINS in log}")
            (traces / f"hogwild-{variant}.collector.log").write_text(log, encoding="utf8")
    report(traces, "hogwild", chosen, args, VARIANTS, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
