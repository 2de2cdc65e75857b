"""train --tensorboard against TensorBoard's own reader (Note [TensorBoard's event files] in
src/io/tensorboard.h): a run of 4 steps stopped after 2 and resumed writes two event files
into one directory; TensorBoard's loader reads every record of both (it checks each
record's CRC-32C), the first event of each file names the format, and each step's scalars
are the --metrics file's numbers of that step, as 32-bit floats, under the same names.

    python check_tensorboard.py path/to/sppo WORKDIR     (exit 77: no tensorboard package)
"""
import glob
import json
import os
import shutil
import subprocess
import sys

try:
    import numpy as np
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
except ImportError as e:
    print(f"skipped: {e} (scripts/install-hf.sh installs TensorBoard)")
    sys.exit(77)

sppo, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
tb, metrics = os.path.join(work, "tb"), os.path.join(work, "m.jsonl")
run = [sppo, "train", "--model", "tiny", "--seq-len", "64", "--steps", "4", "--warmup", "1", "--quiet",
       "--metrics", metrics, "--tensorboard", tb]
subprocess.run(run + ["--stop-after", "2", "--save", os.path.join(work, "ck")], check=True)
subprocess.run([sppo, "train", "--resume", os.path.join(work, "ck"), "--quiet", "--metrics", metrics,
                "--tensorboard", tb], check=True)

files = sorted(glob.glob(os.path.join(tb, "events.out.tfevents.*")))
assert len(files) == 2, f"one event file a run: {files}"
steps = {}
for f in files:
    events = list(EventFileLoader(f).Load())
    assert events[0].file_version == "brain.Event:2", events[0]
    for e in events[1:]:
        assert e.step not in steps, f"step {e.step} twice"
        steps[e.step] = {v.tag: v.tensor.float_val[0] for v in e.summary.value}

lines = [json.loads(line) for line in open(metrics)]
by_step = {m["step"]: m for m in lines if "loss" in m}  # the step lines, not the runs' summaries
assert sorted(steps) == [1, 2, 3, 4] == sorted(by_step), (sorted(steps), sorted(by_step))
for step, scalars in steps.items():
    want = {k: v for k, v in by_step[step].items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k != "step"}
    assert set(scalars) == set(want), (step, sorted(scalars), sorted(want))
    for k, v in want.items():
        assert np.float32(v) == np.float32(scalars[k]), (step, k, v, scalars[k])
for name in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_device_bytes", "peak_host_bytes"):
    assert name in steps[1], name
print(f"ok: {len(files)} event files, steps {sorted(steps)}, {len(steps[1])} scalars a step, equal to {metrics}")
