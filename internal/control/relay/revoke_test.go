package relay

import (
	"net/http/httptest"
	"testing"
)

// TestRevokedTokenIsRefused: a retired episode's token gets 401 at once,
// reaches no model and appends nothing; a restore brings it back.
func TestRevokedTokenIsRefused(t *testing.T) {
	model := newFakeModel(t)
	g, srv := newTestGateway(t, model.srv.URL)
	ep, err := g.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	body := `{"messages":[{"role":"user","content":"hi"}]}`
	if resp, b := gwCall(t, srv.URL, ep.Token, 0, "ep/1", body); resp.StatusCode != 200 {
		t.Fatalf("before the revoke: %d %s", resp.StatusCode, b)
	}
	if err := g.Revoke("ep"); err != nil {
		t.Fatal(err)
	}
	if resp, b := gwCall(t, srv.URL, ep.Token, 0, "ep/2", body); resp.StatusCode != 401 {
		t.Fatalf("a revoked token: %d %s", resp.StatusCode, b)
	}
	if n := model.n.Load(); n != 1 {
		t.Errorf("the model was called %d times, want 1", n)
	}
	l, err := g.ledger("ep")
	if err != nil {
		t.Fatal(err)
	}
	if l.Len() != 1 {
		t.Errorf("the ledger has %d entries after the revoke, want 1", l.Len())
	}
	// The revoke is durable: a restarted gateway refuses it too.
	g2, srv2 := restartGateway(t, g)
	if resp, _ := gwCall(t, srv2.URL, ep.Token, 0, "ep/2", body); resp.StatusCode != 401 {
		t.Fatalf("a revoked token after a restart: %d", resp.StatusCode)
	}
	// A restore (a checkpoint brought back) lifts it, for the next attempt.
	st, err := g2.Restore("ep", false, LedgerAt{Position: 0})
	if err != nil {
		t.Fatal(err)
	}
	if resp, b := gwCall(t, srv2.URL, ep.Token, st.Attempt, "ep/1", body); resp.StatusCode != 200 {
		t.Fatalf("after a restore: %d %s", resp.StatusCode, b)
	}
}

// TestTokenValidOnItsOwnSocketOnly: a token an agent captured is refused
// on its own sandbox's socket; each episode's token works on its own.
func TestTokenValidOnItsOwnSocketOnly(t *testing.T) {
	model := newFakeModel(t)
	g, _ := newTestGateway(t, model.srv.URL)
	a, err := g.AddEpisode("ep-a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := g.AddEpisode("ep-b")
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Bind("ep-a", "sb-a"); err != nil {
		t.Fatal(err)
	}
	if err := g.Bind("ep-b", "sb-b"); err != nil {
		t.Fatal(err)
	}
	sockA := httptest.NewServer(g.SandboxHandler("sb-a"))
	defer sockA.Close()
	sockB := httptest.NewServer(g.SandboxHandler("sb-b"))
	defer sockB.Close()
	unbound := httptest.NewServer(g.SandboxHandler("sb-c"))
	defer unbound.Close()
	body := `{"messages":[{"role":"user","content":"hi"}]}`
	for _, c := range []struct {
		name, url, token, call string
		want                   int
	}{
		{"b's token on a's socket", sockA.URL, b.Token, "ep-b/1", 401},
		{"a's token on b's socket", sockB.URL, a.Token, "ep-a/1", 401},
		{"a's token on a socket no episode is bound to", unbound.URL, a.Token, "ep-a/1", 401},
		{"a's token on a's socket", sockA.URL, a.Token, "ep-a/1", 200},
		{"b's token on b's socket", sockB.URL, b.Token, "ep-b/1", 200},
	} {
		if resp, out := gwCall(t, c.url, c.token, 0, c.call, body); resp.StatusCode != c.want {
			t.Errorf("%s: %d %s, want %d", c.name, resp.StatusCode, out, c.want)
		}
	}
	if n := model.n.Load(); n != 2 {
		t.Errorf("the model was called %d times, want 2 (the refused calls must not reach it)", n)
	}
	// A fork moves the episode: the old sandbox's socket refuses it.
	if err := g.Bind("ep-a", "sb-a2"); err != nil {
		t.Fatal(err)
	}
	if resp, _ := gwCall(t, sockA.URL, a.Token, 0, "ep-a/2", body); resp.StatusCode != 401 {
		t.Errorf("a's token on its old sandbox's socket after a rebind: %d", resp.StatusCode)
	}
}

// TestRestartStartsAFreshAttempt: a retired episode started again from its
// task (Restart) is its next attempt: its token works again, the retired
// attempt's calls are refused as stale, and its ledger starts empty, the
// retired attempt's entries dropped but kept.
func TestRestartStartsAFreshAttempt(t *testing.T) {
	model := newFakeModel(t)
	g, srv := newTestGateway(t, model.srv.URL)
	ep, err := g.AddEpisode("ep")
	if err != nil {
		t.Fatal(err)
	}
	body := `{"messages":[{"role":"user","content":"hi"}]}`
	for _, id := range []string{"ep/1", "ep/2"} {
		if resp, b := gwCall(t, srv.URL, ep.Token, 0, id, body); resp.StatusCode != 200 {
			t.Fatalf("attempt 0, %s: %d %s", id, resp.StatusCode, b)
		}
	}
	if err := g.Revoke("ep"); err != nil {
		t.Fatal(err)
	}
	st, err := g.Restart("ep")
	if err != nil {
		t.Fatal(err)
	}
	if st.Attempt != 1 || st.Revoked || st.NeedMatch || st.Token != ep.Token {
		t.Fatalf("after the restart: %+v", st)
	}
	if resp, b := gwCall(t, srv.URL, ep.Token, 0, "ep/3", body); resp.StatusCode != 409 {
		t.Fatalf("a call of the retired attempt: %d %s", resp.StatusCode, b)
	}
	if resp, b := gwCall(t, srv.URL, ep.Token, 1, "ep/1000001", body); resp.StatusCode != 200 {
		t.Fatalf("the new attempt's first call: %d %s", resp.StatusCode, b)
	}
	l, err := g.ledger("ep")
	if err != nil {
		t.Fatal(err)
	}
	es := l.Entries()
	if len(es) != 1 || es[0].CallID != "ep/1000001" || es[0].Attempt != 1 || es[0].Seq != 1 || es[0].Boundary {
		t.Fatalf("the ledger after the restart: %+v", es)
	}
	if n := model.n.Load(); n != 3 {
		t.Errorf("the model was called %d times, want 3", n)
	}
	// Durable: a restarted gateway is at the new attempt too.
	g2, _ := restartGateway(t, g)
	if st2, err := g2.Episode("ep"); err != nil || st2.Attempt != 1 {
		t.Fatalf("after a gateway restart: %+v %v", st2, err)
	}
}
