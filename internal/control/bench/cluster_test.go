package bench_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"stasis/internal/control/bench"
	"stasis/internal/pgtest"
	"stasis/internal/stasistest"
)

// TestClusterMeasures runs the cluster benchmark small (2 nodes, 8
// episodes) and checks that it measured what it says.
func TestClusterMeasures(t *testing.T) {
	srv := pgtest.Shared(t)
	cpu := t.TempDir()
	rows, err := bench.Cluster(context.Background(), bench.ClusterOptions{
		Exe: os.Args[0], Env: stasistest.Env, Store: srv.URL("postgres"), Sizes: []int{8}, Nodes: 2,
		Settle: time.Millisecond, Timeout: 5 * time.Minute, Dir: t.TempDir(), HeapProfile: t.TempDir(), CPUProfile: cpu,
	})
	if err != nil {
		t.Fatal(err)
	}
	r := rows[0]
	if r.Episodes != 8 || len(r.Memory) != 2 || r.CommitS <= 0 || r.StoreOnlyS <= 0 || r.CheckpointS < r.CommitS {
		t.Fatalf("row %+v", r)
	}
	for _, m := range r.Memory {
		if m.Episodes != 4 || m.BaseKiB <= 0 || m.PeakKiB < m.StartedKiB {
			t.Errorf("node memory %+v", m)
		}
	}
	if fi, err := os.Stat(filepath.Join(cpu, "cpu-8.pb.gz")); err != nil || fi.Size() == 0 {
		t.Errorf("node 1's CPU profile of the checkpoint: %v", err)
	}
	stasistest.NoChildrenLeft(t)
}

// BenchmarkClusterSim is `stasis bench cluster` on the durable test
// PostgreSQL server, with this test binary as the nodes' stasis:
//
//	go test ./internal/control/bench -run '^$' -bench ClusterSim -benchtime 1x -timeout 90m
//
// STASIS_BENCH_SIZES (e.g. 1250,10000), STASIS_BENCH_HEAP and
// STASIS_BENCH_CPU (directories for node 1's heap profiles and CPU
// profiles of the checkpoints) adjust it.
func BenchmarkClusterSim(b *testing.B) {
	sizes := []int{1250, 2500, 5000, 10000}
	if s := os.Getenv("STASIS_BENCH_SIZES"); s != "" {
		sizes = nil
		for _, f := range splitComma(s) {
			var n int
			if _, err := fmt.Sscan(f, &n); err != nil {
				b.Fatalf("STASIS_BENCH_SIZES %q: %v", s, err)
			}
			sizes = append(sizes, n)
		}
	}
	var lease time.Duration // STASIS_BENCH_NODE_LEASE: the nodes' lease (default: bench.Cluster's)
	if s := os.Getenv("STASIS_BENCH_NODE_LEASE"); s != "" {
		var err error
		if lease, err = time.ParseDuration(s); err != nil {
			b.Fatalf("STASIS_BENCH_NODE_LEASE %q: %v", s, err)
		}
	}
	srv := pgtest.SharedDurable(b)
	for range b.N {
		rows, err := bench.Cluster(context.Background(), bench.ClusterOptions{
			Exe: os.Args[0], Env: stasistest.Env, Store: srv.URL("postgres"), Sizes: sizes, Nodes: 4, NodeLease: lease,
			Timeout: 30 * time.Minute, Progress: os.Stderr, HeapProfile: os.Getenv("STASIS_BENCH_HEAP"), CPUProfile: os.Getenv("STASIS_BENCH_CPU"),
		})
		for _, r := range rows {
			base := int64(0)
			for _, m := range r.Memory {
				base = max(base, m.BaseKiB)
			}
			fmt.Printf("episodes=%d start_s=%.1f commit_s=%.2f answer_s=%.2f store_only_s=%.2f commit/store=%.2f xacts=%d xacts/episode=%.2f idle_xacts=%d window_s=%.1f base_rss_mib=%.0f mib/episode=%.3f peak_mib/episode=%.3f commit/commit@first=%.2f\n",
				r.Episodes, r.StartS, r.CommitS, r.CheckpointS, r.StoreOnlyS, r.CommitS/r.StoreOnlyS, r.Transactions, float64(r.Transactions)/float64(r.Episodes),
				r.IdleTransactions, r.WindowS, float64(base)/1024, r.MiBPerEpisode, r.PeakMiBPerEpisode, r.CommitS/rows[0].CommitS)
			for _, m := range r.Memory {
				fmt.Printf("  %s episodes=%d base_mib=%.1f started_mib=%.1f peak_mib=%.1f\n", m.Node, m.Episodes, float64(m.BaseKiB)/1024, float64(m.StartedKiB)/1024, float64(m.PeakKiB)/1024)
			}
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

func splitComma(s string) []string {
	var out []string
	start := 0
	for i := 0; i <= len(s); i++ {
		if i == len(s) || s[i] == ',' {
			if i > start {
				out = append(out, s[start:i])
			}
			start = i + 1
		}
	}
	return out
}
