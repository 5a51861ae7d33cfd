"""Byte units, in one place. Memory is counted in bytes everywhere; these are for the edges:
human output is in GiB (binary, what `free -g` and NVML's tools show), and the seeds' tables and
calculators are in GB (decimal, as the seeds wrote them)."""
KiB = 2 ** 10
MiB = 2 ** 20
GiB = 2 ** 30
GB = 10 ** 9
