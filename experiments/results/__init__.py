"""What runs leave behind: run directories (`rundir.py`), the one metrics record and summaries (`records.py`),
bytes by kind next to their formulas (`bytes.py`), plots (`plots.py`) and report.md (`report.py`), failures
(`faults.py`), a traced run's timeline and its analysis (`timeline.py`) and picture (`gantt.py`)."""
