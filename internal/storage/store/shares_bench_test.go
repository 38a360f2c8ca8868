package store

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"stasis/internal/pgtest"
)

// benchNodes and benchConcurrency are the nodes a checkpoint of
// BenchmarkCheckpointShared spans, and how many of its records each node
// puts at once (the coordinator's default concurrency).
const (
	benchNodes       = 4
	benchConcurrency = 64
)

// BenchmarkCheckpointShared measures what a checkpoint over 4 nodes does to
// the database as the episodes double: 4 nodes join; one begins the
// checkpoint over all 4 (BeginShared); each node, as a process of its own
// would (a store, and so a pool of connections, of its own), puts the
// records of its quarter of the episodes, 64 at once, then finishes its
// share; the last share commits. Snapshots cost nothing here: no sandbox
// is involved, only the store. The server is the durable one (fsync on).
//
// One op is one checkpoint, from BeginShared to the commit. Metrics per
// checkpoint: s/checkpoint; s-commit/checkpoint, the part of it the
// FinishShare that committed took (its check of every record); roundtrips (the statements sent, BEGIN and
// COMMIT and ROLLBACK included, plus the statements prepared: each is one
// round trip to the server; counted by a pgx tracer on every connection of
// the 4 stores), roundtrips/episode, xacts (transactions begun), retries
// (transactions PostgreSQL aborted for a serialization failure or a
// deadlock, which the store runs again); and, when the 1,250 size ran
// before in the same process, time/time@1250, the ratio of the time to
// that at 1,250 episodes (linear is 2, 4, 8).
func BenchmarkCheckpointShared(b *testing.B) {
	var base float64
	for _, episodes := range []int{1250, 2500, 5000, 10000} {
		b.Run(fmt.Sprintf("episodes=%d", episodes), func(b *testing.B) {
			sec := benchSharedCheckpoint(b, episodes)
			if episodes == 1250 {
				base = sec
			}
			if base > 0 {
				b.ReportMetric(sec/base, "time/time@1250")
			}
		})
	}
}

// benchSharedCheckpoint runs b.N checkpoints of episodes over benchNodes
// nodes, reports their figures and returns the seconds one took.
func benchSharedCheckpoint(b *testing.B, episodes int) float64 {
	ctx := context.Background()
	count := &pgCounter{}
	views, nodes := joinCounted(b, pgtest.DurableDSN(b), count, benchNodes)
	manifest := json.RawMessage(`{"step":1}`)
	// A first checkpoint, untimed, of as many episodes as the nodes put at
	// once: the pools open their connections and prepare their
	// statements, as a running node's would have.
	if _, err := checkpointOnce(ctx, "warm-up", views, nodes, manifest, benchNodes*benchConcurrency); err != nil {
		b.Fatal(err)
	}
	before := count.read()
	var commit time.Duration // in the FinishShare that committed
	b.ResetTimer()
	for i := range b.N {
		took, err := checkpointOnce(ctx, fmt.Sprintf("ckpt-%06d", i), views, nodes, manifest, episodes)
		if err != nil {
			b.Fatal(err)
		}
		commit += took
	}
	b.StopTimer()
	got := count.read().minus(before)
	c, err := views[0].List(ctx, ListOptions{State: StateCommitted, Limit: 1})
	if err != nil || len(c) != 1 || c[0].Episodes != episodes {
		b.Fatalf("the last checkpoint committed: %+v %v, want one of %d episodes", c, err, episodes)
	}
	n := float64(b.N)
	sec := b.Elapsed().Seconds() / n
	b.ReportMetric(sec, "s/checkpoint")
	b.ReportMetric(commit.Seconds()/n, "s-commit/checkpoint")
	b.ReportMetric(float64(got.roundTrips())/n, "roundtrips")
	b.ReportMetric(float64(got.roundTrips())/n/float64(episodes), "roundtrips/episode")
	b.ReportMetric(float64(got.begins)/n, "xacts")
	b.ReportMetric(float64(got.retries)/n, "retries")
	return sec
}

// checkpointOnce makes checkpoint id of episodes over nodes, each as its
// view of the store: one begins it, then every node puts its quarter of
// the records and finishes its share. It returns how long the FinishShare
// that committed took.
func checkpointOnce(ctx context.Context, id string, views []*Postgres, nodes []Node, manifest json.RawMessage, episodes int) (time.Duration, error) {
	if err := views[0].BeginShared(ctx, id, manifest, nodes); err != nil {
		return 0, err
	}
	states := make([]State, len(nodes))
	errs := make([]error, len(nodes))
	took := make([]time.Duration, len(nodes))
	var wg sync.WaitGroup
	for k := range nodes {
		wg.Go(func() {
			// The node's quarter: every len(nodes)-th episode.
			var mine []int
			for e := k; e < episodes; e += len(nodes) {
				mine = append(mine, e)
			}
			states[k], took[k], errs[k] = putAndFinish(ctx, views[k], id, nodes[k].Name, mine)
		})
	}
	wg.Wait()
	var commit time.Duration
	committed := 0
	for k := range nodes {
		if errs[k] != nil {
			return 0, fmt.Errorf("node %s: %w", nodes[k].Name, errs[k])
		}
		if states[k] == StateCommitted {
			committed++
			commit = took[k]
		}
	}
	if committed != 1 {
		return 0, fmt.Errorf("checkpoint %s: the shares ended %v, want one committed", id, states)
	}
	return commit, nil
}

// putAndFinish puts the records of episodes (numbers) into checkpoint id
// as node does, benchConcurrency at once, then finishes its share; it
// returns the share's outcome and how long FinishShare took.
func putAndFinish(ctx context.Context, s *Postgres, id, node string, episodes []int) (State, time.Duration, error) {
	sem := make(chan struct{}, benchConcurrency)
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for _, e := range episodes {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			ep := fmt.Sprintf("ep%06d", e)
			if err := s.Put(ctx, id, rec(ep, id+"-"+ep)); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if first != nil {
		return "", 0, first
	}
	start := time.Now()
	st, err := s.FinishShare(ctx, id, node, len(episodes), "")
	return st, time.Since(start), err
}

// joinCounted joins k nodes to the store at dsn, each with a store (a
// pool of connections) of its own, as k processes would, whose every
// connection count traces; it returns each node's view of its store.
func joinCounted(t testing.TB, dsn string, count *pgCounter, k int) ([]*Postgres, []Node) {
	t.Helper()
	views := make([]*Postgres, k)
	nodes := make([]Node, k)
	for i := range k {
		s := openCounted(t, dsn, count)
		n, err := s.Join(context.Background(), fmt.Sprintf("node%d", i+1), "", 10*time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		nodes[i], views[i] = n, s.AsNode(n)
	}
	return views, nodes
}

// openCounted opens the store at dsn with count tracing every connection.
func openCounted(t testing.TB, dsn string, count *pgCounter) *Postgres {
	t.Helper()
	s, err := OpenPostgres(context.Background(), dsn) // makes the schema
	if err != nil {
		t.Fatal(err)
	}
	_ = s.db.Close()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Tracer = count
	s.db = stdlib.OpenDB(*cfg)
	sizePool(s.db)
	t.Cleanup(func() { s.Close() })
	return s
}

// pgCounter counts, as a pgx tracer, what connections send.
type pgCounter struct {
	statements, prepares, begins, retries atomic.Int64
}

// pgCounts is a reading of a pgCounter.
type pgCounts struct{ statements, prepares, begins, retries int64 }

func (c *pgCounter) read() pgCounts {
	return pgCounts{c.statements.Load(), c.prepares.Load(), c.begins.Load(), c.retries.Load()}
}

func (a pgCounts) minus(b pgCounts) pgCounts {
	return pgCounts{a.statements - b.statements, a.prepares - b.prepares, a.begins - b.begins, a.retries - b.retries}
}

// roundTrips: each statement sent is one round trip, and so is each
// statement prepared (the first time a connection runs it).
func (a pgCounts) roundTrips() int64 { return a.statements + a.prepares }

func (c *pgCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.statements.Add(1)
	if strings.HasPrefix(strings.ToLower(strings.TrimSpace(d.SQL)), "begin") {
		c.begins.Add(1)
	}
	return ctx
}

func (c *pgCounter) TraceQueryEnd(_ context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if d.Err != nil && retryablePostgres(d.Err) {
		c.retries.Add(1)
	}
}

func (c *pgCounter) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

func (c *pgCounter) TracePrepareEnd(_ context.Context, _ *pgx.Conn, d pgx.TracePrepareEndData) {
	if !d.AlreadyPrepared {
		c.prepares.Add(1)
	}
}
