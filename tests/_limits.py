"""Time limits in the tests are hang guards only: far above any run on a slow, loaded machine
(the whole default suite takes minutes), so that a test fails for a hang, never for slowness."""

HANG_S = 1200
