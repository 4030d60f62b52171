"""The operations plane: work operators start and keep. Backups and restores (`backup`), recovery on
a restored or older state (`recovery`), jobs (`jobs`), benchmark runs (`benchmarks`), release
evidence (`evidence`) and runtime qualification (`qualification`, `qualify_steps`)."""
