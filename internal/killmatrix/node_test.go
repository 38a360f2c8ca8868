package killmatrix_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"stasis/internal/control/coordinator/crashcheck"
	"stasis/internal/control/model"
	"stasis/internal/control/serve"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/pgtest"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
	"stasis/internal/testwait"
)

// nodeLease is the nodes' lease in the node cells: long enough that a
// node renews it on a loaded machine, short enough that the survivors do
// not wait long for a killed node's to run out.
const nodeLease = 5 * time.Second

var nodeParties = []string{"a node"}

// TestKillMatrixNode kills a node (its `stasis serve`, one of two on
// one PostgreSQL store and one S3 bucket) at each step of its share of a
// checkpoint begun on the other node, and of a restore over both; the
// other keeps running. Recovery: the killed node is started again on its
// state (a new epoch), and an episode of it that is lost is restored from
// the last committed checkpoint.
func TestKillMatrixNode(t *testing.T) {
	if testing.Short() {
		t.Skip("the kill matrix starts servers per cell")
	}
	start := time.Now()
	m := &matrix{}
	for _, st := range steps {
		t.Run(strings.ReplaceAll(st.name, " ", "-"), func(t *testing.T) {
			cellStart := time.Now()
			m.add(runNodeCell(t, st))
			t.Logf("cell node at %q: %.1fs", st.name, time.Since(cellStart).Seconds())
		})
	}
	t.Logf("node matrix: %.0fs", time.Since(start).Seconds())
	if !t.Failed() && len(m.rows) == len(steps) {
		m.check(t, "node", nodeParties)
	}
}

// cluster is the two nodes of a node cell and what they share.
type cluster struct {
	t              *testing.T
	dsn, blobs     string
	states         map[string]string
	procs          map[string]*serveProc
	upstream       string
	s3             *s3test.Server
	bucket, prefix string
}

func (c *cluster) start(name string, env []string) *serveProc {
	p := startServe(c.t, c.states[name], append([]string{"STASIS_BLOBS=" + c.blobs}, env...),
		"--model-upstream", c.upstream, "--store", c.dsn, "--node", name, "--node-lease", nodeLease.String())
	c.procs[name] = p
	return p
}

// driver is the node that drives episode ep now.
func (c *cluster) driver(ep string) *serveProc {
	c.t.Helper()
	v := c.procs["a"].episode(ep)
	p, ok := c.procs[v.Node]
	if !ok {
		c.t.Fatalf("%s is driven by node %q: %+v", ep, v.Node, v)
	}
	return p
}

// snapshots lists the snapshots recorded in the bucket.
func (c *cluster) snapshots() []string {
	cl := c.s3.Client(c.t)
	var out []string
	for obj := range cl.ListObjects(context.Background(), c.bucket, minio.ListObjectsOptions{Prefix: c.prefix, Recursive: true}) {
		if obj.Err != nil {
			c.t.Fatal(obj.Err)
		}
		base := path.Base(obj.Key)
		if strings.Contains(obj.Key, "snapshots/local/") && strings.HasPrefix(base, "snap-") && strings.HasSuffix(base, ".json") {
			out = append(out, strings.TrimSuffix(base, ".json"))
		}
	}
	return out
}

func runNodeCell(t *testing.T, st step) row {
	r := row{provider: "node", party: "a node", step: st}
	ctx := context.Background()
	s3 := s3test.Start(t)
	s3.Setenv(t)
	c := &cluster{t: t, dsn: pgtest.DSN(t), s3: s3, bucket: s3.Bucket(t), prefix: "stasis",
		states: map[string]string{"a": t.TempDir(), "b": t.TempDir()}, procs: map[string]*serveProc{}}
	c.blobs = "s3://" + c.bucket + "/" + c.prefix
	for _, s := range c.states {
		removeGatewayDir(t, s)
	}
	gate := t.TempDir()
	ts, err := task.Builtin()
	if err != nil {
		t.Fatal(err)
	}
	scripts, err := task.Scripts(ts)
	if err != nil {
		t.Fatal(err)
	}
	h := newHolder(model.New(model.Options{Scripts: scripts}))
	msrv := httptest.NewServer(h)
	defer msrv.Close()
	defer h.Release()
	c.upstream = msrv.URL

	a := c.start("a", nil)
	b := c.start("b", []string{serve.StepGateEnv + "=" + gate, serve.StepGateAtEnv + "=" + st.at})
	eps := []string{"ep-a", "ep-b"}
	a.must("POST", "/v1/episodes", map[string]any{"id": "ep-a", "task": cellTask, "harness": "mini"}, http.StatusCreated, nil)
	b.must("POST", "/v1/episodes", map[string]any{"id": "ep-b", "task": cellTask, "harness": "mini"}, http.StatusCreated, nil)
	testwait.Until(t, "the third model call of both episodes", 2*time.Minute, func() bool { return h.Arrivals() >= 2 })

	committed := []string{}
	const ck = "ck-1"
	var op func() answer
	if st.restore {
		a.must("POST", "/v1/checkpoints", map[string]any{"id": "ck-0"}, http.StatusCreated, nil)
		committed = append(committed, "ck-0")
		a.must("POST", "/v1/episodes/ep-a/retire", nil, http.StatusOK, nil)
		b.must("POST", "/v1/episodes/ep-b/retire", nil, http.StatusOK, nil)
		op = func() answer {
			return call(a.Addr, "POST", "/v1/checkpoints/ck-0/restore", map[string]any{"episodes": eps})
		}
	} else {
		op = func() answer { return call(a.Addr, "POST", "/v1/checkpoints", map[string]any{"id": ck}) }
	}
	res := make(chan answer, 1)
	go func() { res <- op() }()
	var reached string
	testwait.Until(t, "node b at "+st.at, 2*time.Minute, func() bool {
		ms, _ := filepath.Glob(filepath.Join(gate, "*.reached"))
		if len(ms) > 0 {
			reached = strings.TrimSuffix(ms[0], ".reached")
			return true
		}
		return false
	})
	b.kill()
	if err := os.WriteFile(reached+".go", nil, 0o644); err != nil {
		t.Fatal(err)
	}
	ans := <-res
	what := map[bool]string{true: "restore", false: "checkpoint"}[st.restore]
	t.Logf("node b SIGKILLed at the gate; the %s on node a answered %s", what, ans)
	if ans.err != nil || ans.code >= 500 {
		// A node's death is no server error: the answer says what
		// became of the operation.
		t.Fatalf("the %s on node a answered %s", what, ans)
	}
	var recovery []string
	var ce struct {
		ContinueError string `json:"continue_error"`
	}
	_ = json.Unmarshal(ans.body, &ce)
	switch {
	case ans.code < 300 && ce.ContinueError != "":
		recovery = append(recovery, fmt.Sprintf("the %s on node a went (%d), its continue_error naming node b's episode, which node b continues when it starts again", what, ans.code))
	case ans.code < 300:
		recovery = append(recovery, fmt.Sprintf("the %s on node a succeeded (%d)", what, ans.code))
	default:
		recovery = append(recovery, fmt.Sprintf("the %s on node a failed (%d: %s)", what, ans.code, shortErr(string(ans.body))))
	}

	// The documented recovery: node b started again on its state.
	b = c.start("b", nil)
	recovery = append(recovery, "node b restarted on its state")
	if !st.restore {
		var got struct {
			Checkpoint store.Checkpoint `json:"checkpoint"`
		}
		if x := call(a.Addr, "GET", "/v1/checkpoints/"+ck, nil); x.code == http.StatusOK {
			a.must("GET", "/v1/checkpoints/"+ck, nil, http.StatusOK, &got)
			if got.Checkpoint.State == store.StateCommitted {
				committed = append(committed, ck)
				r.lost = "nothing (" + ck + " committed)"
			} else {
				r.lost = fmt.Sprintf("the uncommitted %s %s (%s); no committed checkpoint, no delivered ledger entry", ck, got.Checkpoint.State, shortErr(got.Checkpoint.Error))
			}
		} else {
			r.lost = ck + " never begun"
		}
	} else {
		r.lost = "nothing"
	}
	h.Release()

	// Each episode: finished where it is live, or restored when the
	// kill left it not live (lost with node b, or its restore undone).
	var ends []string
	for _, ep := range eps {
		v := a.episode(ep)
		if v.State != store.EpisodeRunning && v.State != store.EpisodeEnded {
			if len(committed) == 0 {
				t.Fatalf("%s is %s and there is no committed checkpoint to restore it from", ep, v.State)
			}
			last := committed[len(committed)-1]
			a.must("POST", "/v1/checkpoints/"+last+"/restore", map[string]any{"episodes": []string{ep}}, http.StatusOK, nil)
			recovery = append(recovery, fmt.Sprintf("%s (%s) restored from %s", ep, v.State, last))
		}
		e := finish(t, c.driver(ep), ep)
		if e.reward != 1 {
			t.Fatalf("%s: %s", ep, e.summary)
		}
		ends = append(ends, e.summary)
	}
	recovery = append(recovery, "both episodes finished")

	// Every committed checkpoint restores over the nodes.
	restored := []string{}
	for _, ck := range committed {
		for _, ep := range eps {
			c.driver(ep).must("POST", "/v1/episodes/"+ep+"/retire", nil, http.StatusOK, nil)
		}
		a.must("POST", "/v1/checkpoints/"+ck+"/restore", map[string]any{"episodes": eps}, http.StatusOK, nil)
		for _, ep := range eps {
			if e := finish(t, c.driver(ep), ep); e.reward != 1 {
				t.Fatalf("%s restored from %s: %s", ep, ck, e.summary)
			}
		}
		restored = append(restored, ck)
	}
	for _, ep := range eps {
		c.driver(ep).must("POST", "/v1/episodes/"+ep+"/retire", nil, http.StatusOK, nil)
	}
	a.stop()
	b.stop()

	// The invariants, on each node opened on its state.
	snaps := c.snapshots()
	for _, name := range []string{"a", "b"} {
		w := stasistest.NewWorld(t, func(cf *system.Config) {
			cf.State, cf.Store, cf.Node, cf.NodeLease, cf.Blobs, cf.LivenessInterval = c.states[name], c.dsn, name, nodeLease, c.blobs, -1
		})
		if err := crashcheck.Check(ctx, crashcheck.System{Coordinator: w.Coordinator, Provider: w.Provider, Store: w.Store, Gateway: w.Gateway, Node: name}, snaps); err != nil {
			t.Fatalf("node %s after the recovery: %v", name, err)
		}
		if name == "b" {
			cks, err := w.Store.List(ctx, store.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			for _, ck := range cks {
				if _, err := w.Coordinator.DeleteCheckpoint(ctx, ck.ID); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	r.survived = fmt.Sprintf("node a and its episode; %s; committed checkpoints, each restored over both nodes and finished: %s", strings.Join(ends, "; "), list(restored))
	r.left = "nothing (crashcheck on each node; no process)"
	r.recovery = strings.Join(recovery, "; ")
	return r
}
