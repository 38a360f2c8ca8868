package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"stasis/errdefs"
	"stasis/internal/pgtest"
	"stasis/internal/testwait"
)

// joinAll joins nodes named names to s with lease, and returns them.
func joinAll(t *testing.T, s *Postgres, lease time.Duration, names ...string) []Node {
	t.Helper()
	var ns []Node
	for _, name := range names {
		n, err := s.Join(context.Background(), name, "", lease)
		if err != nil {
			t.Fatal(err)
		}
		ns = append(ns, n)
	}
	return ns
}

// putShare puts k records for node n into checkpoint id, as n.
func putShare(t *testing.T, s *Postgres, n Node, id string, k int) {
	t.Helper()
	for i := range k {
		if err := s.AsNode(n).Put(context.Background(), id, rec(fmt.Sprintf("%s-ep%d", n.Name, i), fmt.Sprintf("%s-snap%d", n.Name, i))); err != nil {
			t.Fatal(err)
		}
	}
}

// Every share prepared: the last one commits the checkpoint, with every
// node's records; a share finished twice, or after the commit, is refused.
func TestSharesCommitWhenAllPrepared(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	s := openPostgres(t, dsn)
	ns := joinAll(t, s, time.Minute, "a", "b", "c")
	listen := listenChecks(t, dsn)
	if err := s.AsNode(ns[0]).BeginShared(ctx, "ck", nil, ns); err != nil {
		t.Fatal(err)
	}
	listen.want(t, "ck")
	for i, n := range ns {
		putShare(t, s, n, "ck", i+1)
	}
	for i, n := range ns[:2] {
		st, err := s.AsNode(n).FinishShare(ctx, "ck", n.Name, i+1, "")
		if err != nil || st != StatePending {
			t.Fatalf("share of %s: %s %v", n.Name, st, err)
		}
		listen.want(t, "ck")
	}
	st, err := s.AsNode(ns[2]).FinishShare(ctx, "ck", "c", 3, "")
	if err != nil || st != StateCommitted {
		t.Fatalf("the last share: %s %v", st, err)
	}
	listen.want(t, "ck")
	c, recs, err := s.Get(ctx, "ck")
	if err != nil || c.State != StateCommitted || len(recs) != 6 {
		t.Fatalf("checkpoint: %+v, %d records, %v", c, len(recs), err)
	}
	if _, err := s.AsNode(ns[0]).FinishShare(ctx, "ck", "a", 1, ""); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("a share after the commit: %v", err)
	}
	shares, err := s.Shares(ctx, "ck")
	if err != nil || len(shares) != 3 || shares[2].State != SharePrepared || shares[2].Records != 3 || !shares[0].Live {
		t.Fatalf("shares: %+v %v", shares, err)
	}
	if freed, err := s.Delete(ctx, "ck"); err != nil || len(freed) != 6 {
		t.Fatalf("delete: %v %v", freed, err)
	}
	if shares, err := s.Shares(ctx, "ck"); err != nil || len(shares) != 0 {
		t.Fatalf("shares after the delete: %+v %v", shares, err)
	}
}

// A share whose node counted its records wrong fails the commit; a failed
// share fails the checkpoint at once.
func TestSharesFail(t *testing.T) {
	ctx := context.Background()
	s := openPostgres(t, pgtest.DSN(t))
	ns := joinAll(t, s, time.Minute, "a", "b")
	for _, id := range []string{"miscounted", "failed"} {
		if err := s.BeginShared(ctx, id, nil, ns); err != nil {
			t.Fatal(err)
		}
		putShare(t, s, ns[0], id, 1)
		putShare(t, s, ns[1], id, 1)
	}
	if _, err := s.FinishShare(ctx, "miscounted", "a", 1, ""); err != nil {
		t.Fatal(err)
	}
	if st, err := s.FinishShare(ctx, "miscounted", "b", 2, ""); err != nil || st != StateFailed {
		t.Fatalf("a commit with a record missing: %s %v", st, err)
	}
	if st, err := s.FinishShare(ctx, "failed", "a", 0, "snapshot of a-ep0 failed"); err != nil || st != StateFailed {
		t.Fatalf("a failed share: %s %v", st, err)
	}
	c, _, _ := s.Get(ctx, "failed")
	if c.State != StateFailed || !strings.Contains(c.Error, "node a failed its share: snapshot of a-ep0 failed") {
		t.Fatalf("checkpoint: %+v", c)
	}
	if _, err := s.FinishShare(ctx, "failed", "b", 1, ""); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("a share of a failed checkpoint: %v", err)
	}
	if _, err := s.FinishShare(ctx, "failed", "zz", 1, ""); !errors.Is(err, errdefs.ErrConflict) {
		t.Fatalf("a share of no node: %v", err)
	}
}

// Nodes racing to finish the last shares: exactly one commits, and the
// checkpoint is the same whoever it was.
func TestSharesRacingToCommit(t *testing.T) {
	ctx := context.Background()
	s := openPostgres(t, pgtest.DSN(t))
	names := []string{"a", "b", "c", "d"}
	for round := range 5 {
		id := fmt.Sprintf("ck-%d", round)
		ns := joinAll(t, s, time.Minute, suffixed(names, round)...)
		if err := s.BeginShared(ctx, id, nil, ns); err != nil {
			t.Fatal(err)
		}
		for _, n := range ns {
			putShare(t, s, n, id, 2)
		}
		states := make(chan State, len(ns))
		var wg sync.WaitGroup
		for _, n := range ns {
			wg.Go(func() {
				st, err := s.AsNode(n).FinishShare(ctx, id, n.Name, 2, "")
				if err != nil {
					t.Error(err)
				}
				states <- st
			})
		}
		wg.Wait()
		close(states)
		committed := 0
		for st := range states {
			if st == StateCommitted {
				committed++
			}
		}
		c, recs, err := s.Get(ctx, id)
		if committed != 1 || err != nil || c.State != StateCommitted || len(recs) != 2*len(ns) {
			t.Fatalf("round %d: %d commits, checkpoint %+v with %d records, %v", round, committed, c, len(recs), err)
		}
	}
}

func suffixed(names []string, i int) []string {
	out := make([]string, len(names))
	for k, n := range names {
		out[k] = fmt.Sprintf("%s%d", n, i)
	}
	return out
}

// A node that dies mid-prepare: once its lease has run out, any node
// fails the checkpoint; the node, if it comes back under the old epoch,
// can finish nothing.
func TestSharesFailWhenALeaseLapses(t *testing.T) {
	ctx := context.Background()
	s := openPostgres(t, pgtest.DSN(t))
	live := joinAll(t, s, time.Minute, "a")[0]
	dying := joinAll(t, s, time.Second, "b")[0]
	if err := s.BeginShared(ctx, "ck", nil, []Node{live, dying}); err != nil {
		t.Fatal(err)
	}
	putShare(t, s, live, "ck", 1)
	if st, err := s.AsNode(live).FinishShare(ctx, "ck", "a", 1, ""); err != nil || st != StatePending {
		t.Fatalf("a's share: %s %v", st, err)
	}
	if failed, err := s.FailLapsed(ctx, "ck"); err != nil || failed {
		t.Fatalf("FailLapsed while b's lease runs: %v %v", failed, err)
	}
	waitLapsed(t, s, "b")
	if failed, err := s.FailLapsed(ctx, "ck"); err != nil || !failed {
		t.Fatalf("FailLapsed after b's lease ran out: %v %v", failed, err)
	}
	c, _, _ := s.Get(ctx, "ck")
	if c.State != StateFailed || !strings.Contains(c.Error, "lease of node b ran out") {
		t.Fatalf("checkpoint: %+v", c)
	}
	if _, err := s.AsNode(dying).FinishShare(ctx, "ck", "b", 0, ""); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("the dead node's share: %v", err)
	}
	if failed, err := s.FailLapsed(ctx, "ck"); err != nil || failed {
		t.Fatalf("FailLapsed of a failed checkpoint: %v %v", failed, err)
	}
}

// checkListener receives CheckpointNotice notifications.
type checkListener struct{ conn *pgx.Conn }

func listenChecks(t *testing.T, dsn string) *checkListener {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, "LISTEN "+CheckpointNotice); err != nil {
		t.Fatal(err)
	}
	return &checkListener{conn}
}

func (l *checkListener) want(t *testing.T, id string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n, err := l.conn.WaitForNotification(ctx)
	if err != nil || n.Channel != CheckpointNotice || n.Payload != id {
		t.Fatalf("notification: %+v %v", n, err)
	}
}

// The Puts of a checkpoint over several nodes run side by side, 64 at once
// on each node, and do not abort each other (serialization failures, which
// the store runs again): every one succeeds, hardly any is run again, and
// the last share commits every record.
func TestSharedPutsSideBySide(t *testing.T) {
	ctx := context.Background()
	const episodes = 1000
	count := &pgCounter{}
	views, nodes := joinCounted(t, pgtest.DSN(t), count, 4)
	if _, err := checkpointOnce(ctx, "ck", views, nodes, nil, episodes); err != nil {
		t.Fatal(err)
	}
	if r := count.read().retries; r > episodes/20 {
		t.Errorf("%d transactions of %d Puts were aborted and run again", r, episodes)
	}
	c, err := views[0].List(ctx, ListOptions{State: StateCommitted})
	if err != nil || len(c) != 1 || c[0].Episodes != episodes {
		t.Fatalf("committed: %+v %v", c, err)
	}
}

// A node's lease is judged as of the snapshot the judging transaction
// reads: FailLapsed, held up on the checkpoint's row by the nodes' puts,
// must not take leases its old snapshot shows for lapsed ones while the
// nodes went on renewing them (it failed busy checkpoints with every
// node named).
func TestFailLapsedJudgesLeasesAsOfItsSnapshot(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	s := openPostgres(t, dsn)
	const lease = 2 * time.Second
	ns := joinAll(t, s, lease, "a", "b")
	if err := s.BeginShared(ctx, "ck", nil, ns); err != nil {
		t.Fatal(err)
	}
	entered, release := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		held <- s.tx(ctx, false, func(tx *sql.Tx) error {
			if _, err := tx.ExecContext(ctx, `SELECT 1 FROM checkpoints WHERE id = $1 FOR SHARE`, "ck"); err != nil {
				return err
			}
			close(entered)
			<-release
			return nil
		})
	}()
	<-entered
	type result struct {
		failed bool
		err    error
	}
	judged := make(chan result, 1)
	go func() {
		failed, err := s.FailLapsed(ctx, "ck")
		judged <- result{failed, err}
	}()
	other := openPostgres(t, dsn)
	testwait.Until(t, "FailLapsed to wait for the checkpoint's row", 30*time.Second, func() bool {
		var waiting int
		err := other.leases.QueryRowContext(ctx, `SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%FOR UPDATE%'`).Scan(&waiting)
		return err == nil && waiting == 1
	})
	// The nodes keep renewing (a heartbeat, a third of the lease apart)
	// past two whole leases while FailLapsed waits.
	tick := time.NewTicker(lease / 3)
	defer tick.Stop()
	for end := time.Now().Add(2*lease + lease/2); time.Now().Before(end); <-tick.C {
		for _, n := range ns {
			if _, err := other.Renew(ctx, n, lease); err != nil {
				t.Fatal(err)
			}
		}
	}
	close(release)
	if err := <-held; err != nil {
		t.Fatal(err)
	}
	if r := <-judged; r.err != nil || r.failed {
		t.Fatalf("FailLapsed with every node renewing: failed %v, %v", r.failed, r.err)
	}
}
