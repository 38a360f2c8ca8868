package relay

import (
	"context"
	"database/sql"
	"fmt"
	"net/http/httptest"
	"testing"

	"stasis/internal/pgtest"
	"stasis/internal/storage/ledger"
)

// sharedGateways opens n gateways on one PostgreSQL database, as the
// nodes of a cluster share the ledgers and the registrations.
func sharedGateways(t *testing.T, model string, n int) ([]*Gateway, []*httptest.Server) {
	t.Helper()
	dsn := pgtest.DSN(t)
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	var gs []*Gateway
	var srvs []*httptest.Server
	for range n {
		reg, err := OpenRegistryPostgres(context.Background(), db)
		if err != nil {
			t.Fatal(err)
		}
		ls, err := ledger.OpenPostgres(context.Background(), dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ls.Close)
		g, err := OpenGateway(GatewayConfig{Upstream: model, State: t.TempDir(), MaxBody: 1 << 16, Ledgers: ls, Registry: reg})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = g.Close() })
		srv := httptest.NewServer(g.Handler())
		t.Cleanup(srv.Close)
		gs, srvs = append(gs, g), append(srvs, srv)
	}
	return gs, srvs
}

// An episode that runs on node a, then on node b (restarted there as its
// next attempt), then comes back to node a: a's gateway, which opened the
// episode's ledger before b wrote to it, reads it again before it decides
// anything from it. The restart on a takes the ledger b wrote back to its
// start, and a restore on a of a checkpoint b took finds b's entries.
func TestGatewayReadsASharedLedgerAgain(t *testing.T) {
	model := newFakeModel(t)
	gs, srvs := sharedGateways(t, model.srv.URL, 2)
	a, b := gs[0], gs[1]
	ep, err := a.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	call := func(srv *httptest.Server, attempt int, n int64) {
		t.Helper()
		body := fmt.Sprintf(`{"messages":[{"role":"user","content":"call %d"}]}`, n)
		if resp, out := gwCall(t, srv.URL, ep.Token, attempt, fmt.Sprintf("ep/%d", n), body); resp.StatusCode != 200 {
			t.Fatalf("attempt %d, call %d: %d %s", attempt, n, resp.StatusCode, out)
		}
	}
	call(srvs[0], 0, 1)
	// Node b starts it again: attempt 1, and three calls there.
	if st, err := b.Restart("ep"); err != nil || st.Attempt != 1 {
		t.Fatalf("restart on b: %+v %v", st, err)
	}
	for n := int64(1); n <= 3; n++ {
		call(srvs[1], 1, 1_000_000+n)
	}
	bl, _ := b.ledger("ep")
	tip := bl.Tip().Hash // a checkpoint of it, on b
	// Back on a: restarted again from the task.
	st, err := a.Restart("ep")
	if err != nil || st.Attempt != 2 {
		t.Fatalf("restart on a: %+v %v", st, err)
	}
	al, _ := a.ledger("ep")
	if al.Len() != 0 {
		t.Fatalf("after the restart on a the ledger has %d live entries: %s", al.Len(), describeEntries(al.Entries()))
	}
	call(srvs[0], 2, 2_000_001)
	// And b's checkpoint restored on a: its history, whole.
	st, err = a.Restore("ep", true, LedgerAt{Position: 3, Tip: tip})
	if err != nil || st.Attempt != 3 || al.Len() != 3 {
		t.Fatalf("the restore on a of b's checkpoint: %+v %v; %s", st, err, describeEntries(al.Entries()))
	}
	for i, e := range al.Entries() {
		if e.Attempt != 1 || e.CallID != fmt.Sprintf("ep/%d", 1_000_001+i) {
			t.Fatalf("after the restore: %s", describeEntries(al.Entries()))
		}
	}
	if rep, err := ledger.VerifyIn(a.Ledgers(), "ep"); err != nil || !rep.OK || rep.Broken {
		t.Fatalf("verify: %+v %v", rep, err)
	}
}
