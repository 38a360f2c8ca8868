package trainer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/client"
	"stasis/internal/control/model"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/pgtest"
	"stasis/internal/providers/local"
	"stasis/internal/providers/microvm"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
	"stasis/internal/storage/store"
	"stasis/internal/testwait"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// The task every episode plays: a shell task, quick to solve and to
// verify. Each episode id gets a copy of its own (tasks), so that the
// scripted model, which sees only the conversation, knows whose call it
// is answering.
const (
	baseTask = "sh-renext-spaces"
	// turns is how many model calls its script takes from the start.
	turns = 5
)

// lease is the nodes' lease: long enough that a loaded machine renews it,
// short enough that a crash does not wait long for the dead nodes'.
const lease = 5 * time.Second

// maxNodes bounds the nodes of a sequence.
const maxNodes = 3

// world is what one sequence runs on: the scripted model behind a gate,
// in this process (it outlives crashes), the tasks, a PostgreSQL database
// and an S3 bucket of its own, and up to maxNodes `stasis serve --node`
// processes, each with a state directory of its own.
type world struct {
	t     *testing.T
	ctx   context.Context
	dir   string
	tasks string
	gate  *model.Gate
	model *httptest.Server
	dsn   string
	blobs string
	store *store.Postgres // the test's own view, to watch the nodes' leases
	nodes [maxNodes]*node // nil: down
	// ran are the nodes that have run; stopped those stopNodes stopped
	// (SIGTERM), as against those a crash killed and that stayed down.
	ran, stopped [maxNodes]bool
	log          *seqLog
	// concurrency is the nodes' --concurrency: how many episodes a
	// checkpoint or a restore works on at once.
	concurrency int
	// standalone: one `stasis serve` on the embedded defaults (SQLite and
	// files in its state directory, snapshots there too), not a node of a
	// cluster on PostgreSQL and S3.
	standalone bool
	// quiet: the nodes log at info, not debug.
	quiet bool
	// provider is the nodes' --provider ("": local); guestBinary the
	// microvm provider's static in-guest binary.
	provider, guestBinary string
	// nodeLease is the nodes' --node-lease (0: lease).
	nodeLease time.Duration
	// env is added to every node's environment.
	env []string
}

// node is one `stasis serve --node` child.
type node struct {
	*stasistest.Serve
	name, state string
	url         string
	api         *client.Client
}

// slowTask is the copy of baseTask that episode ep-slow plays: its tests
// take two seconds more (a verify of it runs long enough for a
// checkpoint to begin meanwhile).
const slowTask = "tslow"

// taskCopies writes n copies of baseTask into dir, t1 … tn, and slowTask,
// each with a statement of its own (the scripted model picks a script by
// the start of the statement).
func taskCopies(t *testing.T, dir string, n int) {
	t.Helper()
	src := filepath.Join("..", "task", "_builtin", baseTask)
	raw, err := os.ReadFile(filepath.Join(src, "task.json"))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i := 1; i <= n; i++ {
		ids = append(ids, fmt.Sprintf("t%d", i))
	}
	for _, id := range append(ids, slowTask) {
		dst := filepath.Join(dir, id)
		if err := os.CopyFS(dst, os.DirFS(src)); err != nil {
			t.Fatal(err)
		}
		var doc map[string]any
		if err := json.Unmarshal(raw, &doc); err != nil {
			t.Fatal(err)
		}
		doc["id"] = id
		doc["statement"] = fmt.Sprintf("(task copy %s) %s", id, doc["statement"])
		if id == slowTask {
			doc["test_cmd"] = "sleep 2; " + doc["test_cmd"].(string)
		}
		b, err := json.MarshalIndent(doc, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, "task.json"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// taskOf is the task of episode ep-N: its own copy, tN (ep-slow's is
// slowTask).
func taskOf(id string) string { return "t" + strings.TrimPrefix(id, "ep-") }

// newWorld makes a sequence's world, with nodes nodes up; s3 is the test's
// S3 server. Everything it made is gone when t ends.
func newWorld(t *testing.T, ctx context.Context, s3 *s3test.Server, episodes, nodes int, log *seqLog, opts ...func(*world)) *world {
	t.Helper()
	w := &world{t: t, ctx: ctx, dir: t.TempDir(), gate: model.NewGate(), log: log, concurrency: 4}
	for _, o := range opts {
		o(w)
	}
	w.tasks = filepath.Join(w.dir, "tasks")
	taskCopies(t, w.tasks, episodes)
	ts, _, err := task.Load(w.tasks, task.SWEBenchOptions{})
	if err != nil {
		t.Fatal(err)
	}
	scripts, err := task.Scripts(ts)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(scripts[0].Turns); got != turns {
		t.Fatalf("%s's script has %d turns, not the %d the sequences count on", baseTask, got, turns)
	}
	w.model = httptest.NewServer(model.New(model.Options{Scripts: scripts, Gate: w.gate}))
	w.dsn = pgtest.DSN(t)
	w.blobs = "s3://" + s3.Bucket(t) + "/snapshots"
	if w.store, err = store.OpenPostgres(ctx, w.dsn); err != nil {
		t.Fatal(err)
	}
	// Runs last: nothing of the world may be left.
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	t.Cleanup(w.teardown)
	w.startNodes(nodes)
	return w
}

// teardown kills what a failed sequence left (a passing one stopped its
// nodes and retired its episodes) and removes the nodes' socket
// directories.
func (w *world) teardown() {
	if w.t.Failed() {
		for i := range maxNodes {
			if p := filepath.Join(w.dir, fmt.Sprintf("node-%d.log", i+1)); fileExists(p) {
				w.t.Logf("the end of node-%d's log:\n%s", i+1, tail(p, 40))
			}
		}
	}
	for i, n := range w.nodes {
		if n != nil {
			n.Kill()
			w.nodes[i] = nil
		}
	}
	for i := range maxNodes {
		state := w.stateOf(i)
		if _, err := local.Crash(filepath.Join(state, "local")); err != nil {
			w.t.Errorf("kill what node-%d left: %v", i+1, err)
		}
		if _, err := microvm.Crash(filepath.Join(state, microvm.Name)); err != nil {
			w.t.Errorf("kill the machines node-%d left: %v", i+1, err)
		}
		if sock, err := system.GatewaySocket(state); err == nil {
			_ = os.RemoveAll(filepath.Dir(sock))
		}
	}
	w.gate.Open() // the model server's Close waits for the calls it holds
	w.model.Close()
	w.store.Close()
}

// logLevel is the nodes' --log-level: debug, but info in a long soak,
// whose logs would otherwise fill the disk.
func (w *world) logLevel() string {
	if w.quiet {
		return "info"
	}
	return "debug"
}

func (w *world) stateOf(i int) string { return filepath.Join(w.dir, fmt.Sprintf("node-%d", i+1)) }

// up lists the nodes that are up.
func (w *world) up() []*node {
	var out []*node
	for _, n := range w.nodes {
		if n != nil {
			out = append(out, n)
		}
	}
	return out
}

// startNodes starts nodes node-1 … node-n (those not up), at once: a node
// whose last life died waits for its lease to run out first.
func (w *world) startNodes(n int) {
	w.t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		if w.nodes[i] != nil {
			continue
		}
		w.ran[i] = true
		wg.Go(func() { w.nodes[i], errs[i] = w.startNode(i) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			w.t.Fatal(err)
		}
	}
}

// recoverNodes starts again every node that has run and is down: the
// documented recovery of a node a crash took. It finds its sandboxes
// dead, removes what is left of them, and marks lost the episodes it
// drove that no restore placed elsewhere.
func (w *world) recoverNodes() {
	w.t.Helper()
	n := 0
	for i := range maxNodes {
		if w.ran[i] {
			n = i + 1
		}
	}
	w.startNodes(n)
}

// startNode starts node-(i+1) on its state directory.
func (w *world) startNode(i int) (*node, error) {
	n := &node{name: fmt.Sprintf("node-%d", i+1), state: w.stateOf(i)}
	if err := os.MkdirAll(n.state, 0o700); err != nil {
		return nil, err
	}
	args := []string{"--state", n.state, "--tasks", w.tasks,
		"--model-upstream", w.model.URL, "--concurrency", strconv.Itoa(w.concurrency), "--log-format", "json", "--log-level", w.logLevel()}
	if w.provider != "" {
		args = append(args, "--provider", w.provider)
	}
	if w.guestBinary != "" {
		args = append(args, "--guest-binary", w.guestBinary)
	}
	if !w.standalone {
		nl := lease
		if w.nodeLease > 0 {
			nl = w.nodeLease
		}
		args = append(args, "--node", n.name, "--node-lease", nl.String(), "--store", w.dsn, "--blobs", w.blobs)
	}
	var err error
	// The wait bounds a start that hangs.
	n.Serve, err = stasistest.StartServe(stasistest.ServeOptions{Log: filepath.Join(w.dir, n.name+".log"), Env: w.env, Wait: 2 * time.Minute}, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", n.name, err)
	}
	n.url = "http://" + n.Addr
	if n.api, err = client.New(n.url); err != nil {
		n.Kill()
		return nil, err
	}
	return n, nil
}

// stopNodes stops every node with SIGTERM (it leaves its sandboxes
// running: a passing sequence has retired them all).
func (w *world) stopNodes() {
	w.t.Helper()
	for i, n := range w.nodes {
		if n == nil {
			continue
		}
		if err := n.Stop(time.Minute); err != nil { // the minute bounds a stop that hangs
			w.t.Errorf("%s: %v", n.name, err)
		}
		w.nodes[i], w.stopped[i] = nil, true
	}
}

// crash kills everything as a crash of every machine would: each node
// with SIGKILL, and every sandbox of each; then waits until the model no
// longer holds a call of theirs (their connections are gone).
func (w *world) crash() {
	w.t.Helper()
	for i, n := range w.nodes {
		if n == nil {
			continue
		}
		n.Kill()
		w.nodes[i] = nil
	}
	for i := range maxNodes {
		if _, err := local.Crash(filepath.Join(w.stateOf(i), "local")); err != nil {
			w.t.Fatalf("crash node-%d's sandboxes: %v", i+1, err)
		}
	}
	testwait.Until(w.t, "the model holds no call of the crashed nodes", time.Minute, func() bool { return len(w.gate.Waiting()) == 0 })
}

// awaitLeases waits until exactly the nodes that are up hold live leases
// (a dead node's lease runs out within the lease).
func (w *world) awaitLeases() {
	w.t.Helper()
	testwait.Until(w.t, "the dead nodes' leases run out", 3*lease, func() bool {
		ns, err := w.store.Nodes(w.ctx)
		if err != nil {
			return false
		}
		for _, n := range ns {
			i := slices.IndexFunc(w.nodes[:], func(x *node) bool { return x != nil && x.name == n.Name })
			if n.Live != (i >= 0) {
				return false
			}
		}
		return true
	})
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// tail is the last n lines of a file.
func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	ls := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, "\n")
}

// seqLog is a sequence's record of what it did, printed when it fails.
type seqLog struct {
	mu    sync.Mutex
	start time.Time
	lines []string
}

func newSeqLog() *seqLog { return &seqLog{start: time.Now()} }

func (l *seqLog) add(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf("%6.1fs ", time.Since(l.start).Seconds())+fmt.Sprintf(format, args...))
}

func (l *seqLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}
