package job

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"time"

	"stasis/client"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/storage/store"
)

// nodeLease is the lease of a run's nodes: a killed node's episodes can be
// placed elsewhere this long after its last heartbeat.
const nodeLease = 3 * time.Second

// nodeRun is a run over several nodes: one `stasis serve --node` per node,
// each with its own state directory, all on one store and one bucket.
type nodeRun struct {
	o     Options
	opts  []Options // per node: its state directory and name
	nodes []*server // nil for a node that is down
}

// runNodes is Run over o.Nodes nodes: the episodes are started on the
// nodes in turn; the checkpoint is asked of the first and spans them all;
// the crash kills every node and sandbox (SIGKILL), only all but the last
// node come back, and the restore, asked of the first, places the lost
// node's episodes on the survivors, which fork its snapshots from the
// shared bucket.
func runNodes(ctx context.Context, o Options, start time.Time, solvable []*task.Task, modelURL string, turns map[string]int) (rep *Report, err error) {
	r := &nodeRun{o: o}
	for i := range o.Nodes {
		no := o
		no.node = fmt.Sprintf("node-%d", i+1)
		no.State = filepath.Join(o.State, no.node)
		if err := os.MkdirAll(no.State, 0o700); err != nil {
			return nil, err
		}
		r.opts = append(r.opts, no)
	}
	defer func() {
		if cerr := r.cleanup(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	o.Progress.Phase(fmt.Sprintf("start %d nodes", o.Nodes), o.Nodes)
	for i, no := range r.opts {
		s, err := startServer(ctx, no, modelURL)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", no.node, err)
		}
		r.nodes = append(r.nodes, s)
		o.Progress.Set(i + 1)
	}
	o.Progress.Done()

	rep = &Report{Crashed: o.Crash, Nodes: o.Nodes}
	if o.Keep {
		rep.State = o.State
	}
	plan := o.plan(solvable)
	o.Progress.Phase("start episodes", len(plan))
	for i, p := range plan {
		n := r.nodes[i%len(r.nodes)]
		if _, err := n.api.StartEpisode(ctx, client.StartRequest{ID: p.id, Task: p.task, Harness: p.harness}); err != nil {
			return rep, fmt.Errorf("start %s on %s: %w", p.id, r.opts[i%len(r.nodes)].node, err)
		}
		o.Progress.Set(i + 1)
	}
	o.Progress.Done()
	if err := runToCheckpoint(ctx, r, o, plan, turns); err != nil {
		return rep, err
	}
	ckID, finishedAt, err := takeCheckpoint(ctx, r.nodes[0], o, rep)
	if err != nil {
		return rep, err
	}
	var rs restored
	if o.Crash {
		if rs, err = r.crashAndRestore(ctx, modelURL, ckID, rep); err != nil {
			return rep, err
		}
	}
	if err := runToEnd(ctx, r, o, len(plan)); err != nil {
		return rep, err
	}
	if err := verifyAll(ctx, r, o, plan, finishedAt, rs, rep); err != nil {
		return rep, err
	}
	rep.Seconds = time.Since(start).Seconds()
	return rep, nil
}

// episodes lists every episode, each as the node that drives it sees it
// (its harness's status is that node's to say).
func (r *nodeRun) episodes(ctx context.Context) ([]episodeView, error) {
	var out []episodeView
	for i, s := range r.nodes {
		if s == nil {
			continue
		}
		vs, err := s.episodes(ctx)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", r.opts[i].node, err)
		}
		for _, v := range vs {
			if v.Node == r.opts[i].node {
				out = append(out, v)
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

// apiOf is the API of the node that drives episode id.
func (r *nodeRun) apiOf(ctx context.Context, id string) (*client.Client, error) {
	for _, s := range r.nodes {
		if s == nil {
			continue
		}
		v, err := s.api.Episode(ctx, id)
		if err != nil {
			return nil, err
		}
		for i, n := range r.opts {
			if n.node == v.Node && r.nodes[i] != nil {
				return r.nodes[i].api, nil
			}
		}
		return nil, fmt.Errorf("episode %s is driven by node %q, which is down", id, v.Node)
	}
	return nil, errors.New("no node is up")
}

// crashAndRestore kills every node and sandbox, starts all nodes but the
// last again on their state directories, and restores the checkpoint over
// them, asked of the first.
func (r *nodeRun) crashAndRestore(ctx context.Context, modelURL, ckID string, rep *Report) (restored, error) {
	rs := restored{why: map[string]string{}, clockStep: map[string]*float64{}}
	o := r.o
	o.Progress.Phase("crash every node", 1)
	for i, s := range r.nodes {
		_ = s.cmd.Process.Signal(syscall.SIGKILL)
		_ = s.cmd.Wait()
		s.log.Close()
		r.nodes[i] = nil
		n, err := crashSandboxes(r.opts[i].State)
		if err != nil {
			return rs, fmt.Errorf("crash: %w", err)
		}
		rep.Killed += n
	}
	o.Progress.Set(1)
	o.Progress.Done()
	survivors := len(r.opts) - 1
	o.Progress.Phase(fmt.Sprintf("start %d of %d nodes", survivors, len(r.opts)), survivors)
	for i := range survivors {
		s, err := startServer(ctx, r.opts[i], modelURL)
		if err != nil {
			return rs, fmt.Errorf("%s: %w", r.opts[i].node, err)
		}
		r.nodes[i] = s
		o.Progress.Set(i + 1)
	}
	o.Progress.Done()
	// The lost node's lease must run out before its episodes can be
	// placed elsewhere.
	if err := pause(ctx, nodeLease+time.Second); err != nil {
		return rs, err
	}
	o.Progress.Phase("restore", 1)
	t0 := time.Now()
	res, err := r.nodes[0].api.Restore(ctx, ckID)
	if err != nil {
		return rs, fmt.Errorf("restore: %w", err)
	}
	for _, sh := range res.Shares {
		for _, ep := range sh.Episodes {
			rs.why[ep] = "restored on " + sh.Node
		}
	}
	rep.Restore = &struct {
		Seconds float64 `json:"seconds"`
	}{time.Since(t0).Seconds()}
	o.Progress.Set(1)
	o.Progress.Done()
	return rs, nil
}

// cleanup retires every episode through its node, stops the nodes, and
// kills any sandbox still there.
func (r *nodeRun) cleanup() error {
	var errs []error
	// Each episode retired by the node that drives it (another node would
	// only mark its row: the sandbox is not its provider's).
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if views, err := r.episodes(ctx); err == nil {
		for _, v := range views {
			if v.State == store.EpisodeRetired {
				continue
			}
			if api, err := r.apiOf(ctx, v.ID); err == nil {
				if _, err := api.Retire(ctx, v.ID); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	for i, s := range r.nodes {
		if s != nil {
			errs = append(errs, cleanup(s, r.opts[i]))
			continue
		}
		// A node that is down: its sandboxes, and its gateway's socket
		// directory, which only its server would have removed.
		if n, err := crashSandboxes(r.opts[i].State); err != nil {
			errs = append(errs, err)
		} else if n > 0 {
			r.o.Log.Warn("killed sandboxes a node left", "node", r.opts[i].node, "n", n)
		}
		if sock, err := system.GatewaySocket(r.opts[i].State); err == nil {
			errs = append(errs, os.RemoveAll(filepath.Dir(sock)))
		}
	}
	return errors.Join(errs...)
}
