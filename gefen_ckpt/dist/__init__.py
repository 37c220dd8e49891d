"""The live optimizer under a process group: its state as canonical parts, the agreement protocol,
which rank holds and writes which rows, sharded save/load and read-once loads. May import .io, .state, .wire, .formats."""
