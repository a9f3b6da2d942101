"""The commands that run and check the stack as a whole, one module each (`sps-driving COMMAND`,
sps_driving/cli.py): demo, replay, interventions, record, faults and bench; bench_report renders
bench's JSON and peak.py measures the machine's GEMM peak that bench reports against."""
