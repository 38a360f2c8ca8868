package trainer_test

import (
	"context"
	"flag"
	"fmt"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"stasis/internal/s3test"
)

var (
	seedsFlag = flag.Int("seeds", 4, "random trainer sequences to run, seeds -first, -first+1, …")
	firstFlag = flag.Uint64("first", 1, "the first seed of -seeds")
	seedFlag  = flag.Uint64("seed", 0, "run this one seed only (replays a failing one)")
	soakFlag  = flag.Duration("soak-time", 0, "with -seeds: start no new seed once this long has passed (0: no bound)")
)

// sequenceLen bounds a sequence's operations: its seed picks from 6 to
// 12 (before the drain).
const (
	minOps = 6
	maxOps = 12
	// maxEpisodes bounds the episode ids a sequence starts.
	maxEpisodes = 4
)

// TestRandomSequences runs random trainer sequences through the server
// API, one per seed (-seeds, -first; -seed replays one), and checks the
// invariants after each (checkInvariants). A failing seed prints its
// number, how to replay it and its sequence.
func TestRandomSequences(t *testing.T) {
	s3 := s3test.Start(t)
	s3.Setenv(t)
	seeds := []uint64{}
	if *seedFlag != 0 {
		seeds = append(seeds, *seedFlag)
	} else {
		for i := range *seedsFlag {
			seeds = append(seeds, *firstFlag+uint64(i))
		}
	}
	start := time.Now()
	ran, failed := 0, []uint64{}
	totals := map[string]int{}
	stop := stopOnSignal(t)
	for _, seed := range seeds {
		if *soakFlag > 0 && time.Since(start) > *soakFlag {
			t.Logf("soak time %s is up after %d seeds", *soakFlag, ran)
			break
		}
		if stop() {
			t.Logf("stopped by a signal after %d seeds", ran)
			break
		}
		ok := t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			for k, n := range runSeed(t, s3, seed) {
				totals[k] += n
			}
		})
		ran++
		if !ok {
			failed = append(failed, seed)
		}
	}
	t.Logf("%d seeds in %s; failed: %v; %s", ran, time.Since(start).Round(time.Second), failed, counts(totals))
}

// stopOnSignal catches SIGTERM and SIGINT for the rest of the test and
// returns whether one came: a soak asked to stop finishes the seed or the
// cycle under way, checks it and cleans up, instead of dying with its
// servers and sandboxes left running.
func stopOnSignal(t *testing.T) func() bool {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT)
	t.Cleanup(func() { signal.Stop(ch) })
	stopped := false
	return func() bool {
		select {
		case <-ch:
			stopped = true
		default:
		}
		return stopped
	}
}

// counts is a map of counts in key order.
func counts(m map[string]int) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

// runSeed runs the sequence of one seed, checks its invariants, and
// returns what it did, counted.
func runSeed(t *testing.T, s3 *s3test.Server, seed uint64) map[string]int {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	log := newSeqLog()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("seed %d failed; replay it with: go test ./internal/control/trainer -run 'TestRandomSequences' -args -seed %d\nits sequence:\n%s", seed, seed, log)
		}
	})
	d := newDriver(nil, seed, maxEpisodes)
	nodes := 1 + d.rng.IntN(maxNodes)
	ops := minOps + d.rng.IntN(maxOps-minOps+1)
	log.add("seed %d: %d nodes, %d operations", seed, nodes, ops)
	d.w = newWorld(t, ctx, s3, maxEpisodes, nodes, log)
	d.runSequence(ops)
	d.checkInvariants()
	d.ops["model calls"] = len(d.w.gate.Passed())
	d.ops["committed checkpoints"] = len(d.ckpts)
	d.ops["episodes"] = len(d.episodes)
	t.Logf("seed %d: %d operations in %s: %s", seed, ops, time.Since(log.start).Round(time.Second), counts(d.ops))
	return d.ops
}
