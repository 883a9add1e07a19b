"""`kvdepot status`, in one place: an operator's Admin client, outside the daemon.

`command.py` is the command (its arguments, reading the daemon's operator socket, once
or `--watch`); `report.py` gathers one reading of every shard into a report (plain
dicts); `copies.py` says how busy the copy threads and the event loop were between two
readings; `render.py` prints a report with rich. Each imports only the ones after it
(the `status` contract in pyproject.toml). The daemon imports none of them.
"""
