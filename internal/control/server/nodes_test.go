package server_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/server"
	"stasis/internal/pgtest"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
)

// Two `stasis serve --node` processes on one PostgreSQL store, an episode
// started on each: a checkpoint asked of node a takes both nodes'
// episodes, each node its own share. Node b is then killed with SIGKILL;
// the next checkpoint asked of a fails once b's lease has run out, naming
// b, and the first stays the latest. Started again on its state, b
// re-attaches its episode (a new epoch of its name), and both episodes
// finish with reward 1. Node a answers for node b's episode by forwarding
// the request to b.
func TestServeNodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	stateA, stateB := t.TempDir(), t.TempDir()
	cleanState(t, stateA)
	cleanState(t, stateB)
	args := func(name string) []string {
		return []string{"--store", dsn, "--node", name, "--node-lease", "2s"}
	}
	a := startServe(t, stateA, args("a")...)
	b := startServe(t, stateB, args("b")...)
	for _, n := range []struct {
		p  *serveProc
		ep string
	}{{a, "ep-a"}, {b, "ep-b"}} {
		n.p.api().call("POST", "/v1/episodes", map[string]any{"id": n.ep, "task": "sh-renext-spaces", "harness": "mini"}, http.StatusCreated, nil)
	}
	var ck server.CheckpointResponse
	a.api().call("POST", "/v1/checkpoints", map[string]any{"id": "ck-1"}, http.StatusCreated, &ck)
	if len(ck.Shares) != 2 || ck.Shares[0].Node != "a" || ck.Shares[1].Node != "b" || len(ck.Episodes) != 1 || ck.Episodes[0].Episode != "ep-a" {
		t.Fatalf("checkpoint over two nodes: %+v", ck)
	}
	for _, sh := range ck.Shares {
		if sh.State != store.SharePrepared || sh.Records != 1 {
			t.Fatalf("share: %+v", sh)
		}
	}
	var got struct {
		Checkpoint store.Checkpoint `json:"checkpoint"`
		Records    []store.Record   `json:"records"`
	}
	b.api().call("GET", "/v1/checkpoints/ck-1", nil, http.StatusOK, &got)
	if got.Checkpoint.State != store.StateCommitted || len(got.Records) != 2 {
		t.Fatalf("ck-1 as node b serves it: %+v", got)
	}

	// A request about node b's episode asked of node a is answered by b,
	// which drives it (its supervisor's status is b's to read); one
	// already forwarded is answered where it lands.
	if v := a.api().episode("ep-b"); !v.Live || v.Node != "b" || v.Status == nil {
		t.Fatalf("ep-b asked of node a: %+v", v)
	}
	forwarded := a.api()
	forwarded.header = map[string]string{server.ForwardedBy: "c"}
	if v := forwarded.episode("ep-b"); v.Live || v.Node != "b" {
		t.Fatalf("ep-b asked of node a, forwarded already: %+v", v)
	}
	forwarded.refuse("POST", "/v1/episodes/ep-b/retire", nil, http.StatusConflict, "conflict", "driven by node b")

	// The same from the command line, outside the cluster.
	out, errOut, code := stasistest.Run(t, nil, "", "ckpt", "create", "ck-cli", "--store", dsn, "--json")
	var made struct {
		Checkpoint string        `json:"checkpoint"`
		Shares     []store.Share `json:"shares"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &made) != nil || made.Checkpoint != "ck-cli" || len(made.Shares) != 2 || made.Shares[1].State != store.SharePrepared {
		t.Fatalf("stasis ckpt create: exit %d: %s %s", code, out, errOut)
	}
	if out, _, code := stasistest.Run(t, nil, "", "ckpt", "ls", "--store", dsn); code != 0 || !strings.Contains(out, "ck-cli") || !strings.Contains(out, "ck-1") {
		t.Fatalf("stasis ckpt ls --store: exit %d: %s", code, out)
	}
	if _, errOut, code := stasistest.Run(t, nil, "", "ckpt", "create", "ck-x"); code != 2 || !strings.Contains(errOut, "--store postgres://") {
		t.Fatalf("stasis ckpt create without a store: exit %d: %s", code, errOut)
	}

	b.kill()
	status, body := a.api().do("POST", "/v1/checkpoints", map[string]any{"id": "ck-2"})
	if status != http.StatusConflict || !strings.Contains(string(body), "lease of node b ran out") {
		t.Fatalf("a checkpoint with node b dead: %d %s", status, body)
	}
	a.api().call("GET", "/v1/checkpoints/ck-1", nil, http.StatusOK, &got)
	if got.Checkpoint.State != store.StateCommitted {
		t.Fatalf("ck-1 after the failed one: %+v", got.Checkpoint)
	}

	// Started again at an address nobody answers on, node b cannot be
	// forwarded to: node a says so.
	b = startServe(t, stateB, append(args("b"), "--node-addr", "http://127.0.0.1:9")...)
	a.api().refuse("GET", "/v1/episodes/ep-b", nil, http.StatusBadGateway, "node_unreachable", "driven by node b at http://127.0.0.1:9, which did not answer")
	b.stop()
	// Started again as it should be, node b's episode is waited for,
	// verified and retired through node a.
	b = startServe(t, stateB, args("b")...)
	for _, n := range []struct {
		p  *serveProc
		ep string
	}{{a, "ep-a"}, {a, "ep-b"}} {
		api := n.p.api()
		api.waitExited(ctx, n.ep)
		// Verified once, by the checkpoint if it had ended by then.
		api.call("POST", "/v1/episodes/"+n.ep+"/verify", nil, http.StatusOK, nil)
		if v := api.episode(n.ep); !v.LedgerOK || v.Reward == nil || *v.Reward != 1 {
			t.Fatalf("%s at the end: %+v", n.ep, v)
		}
		api.call("POST", "/v1/episodes/"+n.ep+"/retire", nil, http.StatusOK, nil)
	}
	a.stop()
	b.stop()
}

// A restore's body is checked before anything is touched: an empty list of
// episodes, an unknown field, a name the checkpoint lacks.
func TestRestoreRequestRefused(t *testing.T) {
	ctx := context.Background()
	state := t.TempDir()
	cleanState(t, state)
	r := startServer(t, ctx, state, nil)
	defer r.Close()
	api := r.api
	api.refuse("POST", "/v1/checkpoints/nope/restore", map[string]any{"episodes": []string{}}, http.StatusBadRequest, "invalid_request", "episodes is empty")
	api.refuse("POST", "/v1/checkpoints/nope/restore", map[string]any{"shiny": 1}, http.StatusBadRequest, "invalid_request", "unknown field")
	api.refuse("POST", "/v1/checkpoints/nope/restore", map[string]any{"episodes": []string{"ep-x"}}, http.StatusNotFound, "not_found", "nope")
	var ck server.CheckpointResponse
	api.call("POST", "/v1/checkpoints", map[string]any{"id": "ck-empty"}, http.StatusCreated, &ck)
	api.refuse("POST", "/v1/checkpoints/ck-empty/restore", map[string]any{"episodes": []string{"ep-x"}}, http.StatusNotFound, "not_found", "ep-x is not in checkpoint ck-empty")
}
