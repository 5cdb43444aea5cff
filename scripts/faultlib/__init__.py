"""A randomized fault test with a seed (Jepsen's nemeses, FoundationDB's simulation), run by
scripts/fault_test.py and tests/test_fault_random.py.

- ``workload``: the seeded prompt pool and operation mix every client draws from;
- ``history``: the JSONL record every client writes of each operation (start, accepted, end);
- ``client``: a client process (sync ``Client``, ``AsyncClient`` or the gateway over HTTP with ``openai``);
- ``fleet``: the processes under test: a private Redis (AOF, appendfsync always), workers, the gateway,
  client processes and ``batchfleet bulk`` runs, each one killable, restartable and pausable;
- ``nemesis``: the seeded fault schedule acting on the fleet;
- ``reference``: each prompt run alone on an undisturbed worker at the end (greedy decoding);
- ``checker``: every history against the references: lost, twice, wrong, untyped, late;
- ``run``: one run from start to summary.
"""
