// Package trainer holds the random trainer sequences (issue 23): tests
// that drive real `stasis serve` nodes only through their HTTP API
// (package client), the way an RL trainer drives them, with seeded random
// sequences of operations: start episodes, let their model calls through
// (the scripted model holds them at a gate), checkpoint, checkpoint right
// after starting episodes, start an episode while a checkpoint runs,
// continue, crash everything and restore the latest committed checkpoint
// (sometimes onto another number of nodes), and retire an episode and
// start it again as its next attempt. The nodes form a cluster on one
// PostgreSQL store and one S3 bucket (the local provider's snapshots are
// kept there), so a restore forks any node's snapshots on any node.
//
// After every sequence the invariants hold (invariants_test.go says where
// each is checked): every episode is resolved, or failed in a way the
// sequence caused (lost to a crash no checkpoint covered); the scripted
// model made no call an episode did not need (no call its harness had
// been given was asked again after a restore); every node, gateway and
// provider is idle with nothing left; every committed checkpoint still
// restores; and every ledger verifies, one lineage per episode with no
// call of a dead attempt in it.
//
// `go test ./internal/control/trainer` runs four seeds and the fixed
// scenarios; `make soak-sequences SEEDS=N SOAK_TIME=D` runs as many seeds
// as it is given, bounded by count and time. A failing seed prints its
// number and its sequence; `-seed N` replays it.
//
// It also holds the cycle soak (TestSoakCycles, cycles_test.go; `make
// soak-cycles`, skipped unless -cycles is given): many episodes kept live
// through many checkpoint/restore cycles, on one server or a cluster, on
// the local or the microVM provider, with each node's resources sampled
// after every cycle, to find what grows.
package trainer
