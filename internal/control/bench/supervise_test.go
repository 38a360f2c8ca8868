package bench_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"stasis/internal/control/bench"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
	"stasis/internal/stasistest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// TestSuperviseMeasures runs the benchmark briefly and checks that it
// measured what it says, and cleaned up after itself.
func TestSuperviseMeasures(t *testing.T) {
	dir := t.TempDir()
	rows, err := bench.Supervise(context.Background(), bench.SuperviseOptions{
		Exe: os.Args[0], Env: stasistest.Env, Sizes: []int{1, 4}, Iterations: 5, Dir: dir,
		Modes: []supervisor.Mode{supervisor.ModeHold, supervisor.ModeStop},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 4 {
		t.Fatalf("%d rows, want 4", len(rows))
	}
	for _, r := range rows {
		if r.Iterations != 5 || r.Pause.P50 <= 0 || r.Pause.P99 < r.Pause.P50 || r.Baseline.P50 <= 0 || r.PeakRSSKiB <= 0 || r.Unconfirmed != 0 {
			t.Errorf("row %+v", r)
		}
		if (r.Mode == supervisor.ModeStop) != (r.Kernel != nil) {
			t.Errorf("kernel baseline present for %s: %v", r.Mode, r.Kernel != nil)
		}
	}
	stasistest.NoChildrenLeft(t)
	if _, err := bench.Supervise(context.Background(), bench.SuperviseOptions{Exe: os.Args[0], Env: stasistest.Env, Sizes: []int{0}, Modes: []supervisor.Mode{supervisor.ModeHold}}); err == nil {
		t.Fatal("a tree of 0 processes was accepted")
	}
}

// BenchmarkPause times one pause acknowledgement (the continue is not
// timed) for each mode and tree size; ns/op is the pause round trip.
// `stasis bench supervise` reports p50 and p99 of the same measurement.
func BenchmarkPause(b *testing.B) {
	for _, mode := range []supervisor.Mode{supervisor.ModeHold, supervisor.ModeStop} {
		for _, n := range []int{1, 10, 50} {
			b.Run(string(mode)+"/"+strconv.Itoa(n), func(b *testing.B) {
				dir := b.TempDir()
				c, err := supervisor.Spawn(context.Background(), supervisor.SpawnOptions{
					Exe: os.Args[0], Env: stasistest.Env, Dir: dir,
					Flags: []string{"--mode", string(mode), "--log-level", "error"},
					Argv:  []string{"/bin/sh", "-c", `i=1; while [ "$i" -lt "$1" ]; do sleep 3600 & i=$((i+1)); done; exec sleep 3600`, "h", strconv.Itoa(n)},
				})
				if err != nil {
					b.Fatal(err)
				}
				defer func() { _, _ = c.Stop(context.Background(), 30*time.Second) }()
				deadline := time.Now().Add(30 * time.Second)
				for {
					d, _ := proc.Descendants(c.Cmd.Process.Pid)
					if len(d) >= n+1 {
						break
					}
					if time.Now().After(deadline) {
						b.Fatal("tree not up")
					}
					time.Sleep(2 * time.Millisecond) // poll interval, bounded by the deadline above
				}
				ctx := context.Background()
				b.ResetTimer()
				for i := 1; i <= b.N; i++ {
					if _, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpPause, Seq: int64(i)}); err != nil {
						b.Fatal(err)
					}
					b.StopTimer()
					if _, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpContinue, Seq: int64(i)}); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
			})
		}
	}
}

func TestSandboxStartMeasures(t *testing.T) {
	home := t.TempDir()
	r, err := bench.SandboxStart(context.Background(), bench.SandboxStartOptions{Exe: stasistest.Exe(), Env: stasistest.Env, Home: home, N: 3})
	if err != nil {
		t.Fatal(err)
	}
	if r.N != 3 || r.CreateExec.P50 <= 0 || r.CreateExec.P50 < r.Create.P50 || r.Bwrap.P50 <= 0 {
		t.Fatalf("%+v", r)
	}
	stasistest.NoChildrenLeft(t)
}

func TestRelayMeasures(t *testing.T) {
	r, err := bench.Relay(context.Background(), bench.RelayOptions{Concurrency: []int{1, 4}, LatencyCalls: 20, ThroughputCalls: 40, Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if r.Direct.P50 <= 0 || r.Relayed.P50 <= r.Direct.P50/2 || len(r.Rows) != 2 || r.Rows[1].Relayed <= 0 || r.Rows[1].Direct <= 0 {
		t.Fatalf("%+v", r)
	}
}
