"""The fleet plane: the nodes and the channel to them. Enrollment, liveness and assignment sets
(`nodes`), the node protocol (`southbound`), what nodes claim (`claims`) and may receive (`grants`),
and the controller's keys (`keyring`)."""
