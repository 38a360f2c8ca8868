package coordinator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"stasis/checkpoint"
	"stasis/episode"
	"stasis/relay"
	"stasis/store"
)

// Branch continues one episode of a committed checkpoint as len(copies)
// new episodes, named copies, each in its own fork of the episode's
// snapshot: RL users branch rollouts from one state. Where the snapshot
// kept the processes each copy resumes in place (episode.ResumeCopy),
// otherwise it is relaunched from the saved session (episode.RelaunchCopy);
// either way each copy has its own gateway registration and a ledger that
// starts as a copy of the episode's up to the recorded position. The
// episode itself is not touched: it may be live. All or nothing: if any
// copy fails, every sandbox and registration the branch made is undone
// and the store is unchanged.
func (c *Coordinator) Branch(ctx context.Context, id, episodeID string, copies []string) (Result, error) {
	c.op.Lock()
	defer c.op.Unlock()
	start := time.Now()
	res := Result{Checkpoint: id, Phases: map[string]float64{}}
	recs, err := c.committed(ctx, id, "branches")
	if err != nil {
		return res, err
	}
	var r *store.Record
	for i := range recs {
		if recs[i].Episode == episodeID {
			r = &recs[i]
		}
	}
	if r == nil {
		return res, fmt.Errorf("checkpoint %s has no record of episode %s: %w", id, episodeID, store.ErrNotFound)
	}
	var problems []string
	if len(copies) == 0 {
		problems = append(problems, "no copies asked for")
	}
	if r.Finished {
		problems = append(problems, fmt.Sprintf("episode %s had ended at the checkpoint: there is no state to branch from", episodeID))
	}
	if r.Provider != c.o.Env.Provider.Name() {
		problems = append(problems, fmt.Sprintf("episode %s: recorded on provider %s, this coordinator runs %s", episodeID, r.Provider, c.o.Env.Provider.Name()))
	}
	seen := map[string]bool{}
	for _, name := range copies {
		switch {
		case !relay.ValidName(name):
			problems = append(problems, fmt.Sprintf("copy %q: use letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128", name))
		case name == episodeID:
			problems = append(problems, fmt.Sprintf("copy %s: that is the episode's own name", name))
		case seen[name]:
			problems = append(problems, fmt.Sprintf("copy %s is named twice", name))
		default:
			if _, err := c.o.Store.GetEpisode(ctx, name); err == nil {
				problems = append(problems, fmt.Sprintf("copy %s: an episode of that name exists", name))
			} else if !errors.Is(err, store.ErrNotFound) {
				problems = append(problems, fmt.Sprintf("copy %s: %v", name, err))
			} else if _, err := c.o.Env.Gateway.Episode(name); err == nil {
				// Left by an interrupted branch: the undo below removes only
				// what this branch registers.
				problems = append(problems, fmt.Sprintf("copy %s: the gateway already has an episode of that name (and a ledger) that no episode row names", name))
			}
		}
		seen[name] = true
	}
	row, err := c.o.Store.GetEpisode(ctx, episodeID)
	var spec episode.Spec
	if err == nil {
		spec, err = c.specOf(row)
	}
	if err != nil {
		problems = append(problems, fmt.Sprintf("episode %s: %v", episodeID, err))
	}
	if !r.Finished && r.Provider == c.o.Env.Provider.Name() {
		problems = append(problems, c.forkProblems(ctx, *r)...)
	}
	res.Phases["validate"] = time.Since(start).Seconds()
	if len(problems) > 0 {
		return res, refused{fmt.Sprintf("checkpoint %s: episode %s cannot be branched; nothing was changed:\n  %s", id, episodeID, strings.Join(problems, "\n  "))}
	}

	t := time.Now()
	forks, err := c.o.Env.Provider.Fork(ctx, r.SnapshotID, len(copies), episode.ForkSpec(spec))
	res.Phases["fork"] = time.Since(t).Seconds()
	if err != nil {
		return res, fmt.Errorf("checkpoint %s: branch episode %s: fork %s: %w", id, episodeID, r.SnapshotID, err)
	}
	t = time.Now()
	var (
		mu      sync.Mutex
		made    = map[string]*episode.Episode{}
		figs    = map[string]EpisodeFigures{}
		sandbox = map[string]string{}
	)
	for i, name := range copies {
		sandbox[name] = forks[i].ID
	}
	err = c.each(copies, "branch", func(name string) error {
		e, f, err := c.continueFork(ctx, spec, sandbox[name], *r, name)
		if err != nil {
			return err
		}
		mu.Lock()
		made[name], figs[name] = e, f
		mu.Unlock()
		return nil
	})
	res.Phases["resume"] = time.Since(t).Seconds()
	undo := func() {
		for _, e := range made {
			_ = e.Close(context.WithoutCancel(ctx))
		}
		for _, name := range copies {
			if err := c.deleteSandbox(context.WithoutCancel(ctx), sandbox[name]); err != nil {
				c.log.Warn("delete a fork of a failed branch", "sandbox", sandbox[name], "err", err)
			}
			if _, err := c.o.Env.Gateway.Episode(name); err == nil {
				if err := c.o.Env.Gateway.Remove(name); err != nil {
					c.log.Warn("remove a copy of a failed branch from the gateway", "episode", name, "err", err)
				}
			}
		}
	}
	if err != nil {
		undo()
		return res, fmt.Errorf("checkpoint %s: branch of episode %s failed, every sandbox and copy it made undone: %w", id, episodeID, err)
	}
	rows := make([]store.Episode, 0, len(copies))
	for _, name := range copies {
		e := made[name]
		rows = append(rows, store.Episode{
			ID: name, Origin: spec.ID, Task: row.Task, Harness: row.Harness, Provider: c.o.Env.Provider.Name(),
			Sandbox: e.SandboxID(), Attempt: e.Attempt(), PauseSeq: r.PauseSeq, State: store.EpisodeRunning,
			DeadlineS: row.DeadlineS, Limits: row.Limits, Image: row.Image, Environment: e.Environment().String(), Resume: figs[name].Resume,
		})
		res.Episodes = append(res.Episodes, figs[name])
	}
	if err := c.o.Store.PutEpisodes(ctx, rows); err != nil {
		undo()
		return res, fmt.Errorf("checkpoint %s: branch of episode %s failed, every sandbox and copy it made undone: record the copies: %w", id, episodeID, err)
	}
	c.mu.Lock()
	for name, e := range made {
		c.live[name] = e
	}
	c.mu.Unlock()
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}

// continueFork continues record r's episode in sb, a fork of its snapshot:
// in place when the record allows it and the fork's supervisor is the
// recorded launch, relaunched from its saved session otherwise; as copy
// name (a branch) unless name is "". The figures say which, and why.
func (c *Coordinator) continueFork(ctx context.Context, spec episode.Spec, sb string, r store.Record, name string) (*episode.Episode, EpisodeFigures, error) {
	f := EpisodeFigures{Episode: r.Episode, Resume: "relaunch", ResumeWhy: fmt.Sprintf("the %s provider's snapshot kept files only (keeps_processes false): the harness is relaunched from its saved session", r.Provider)}
	if name != "" {
		f.Episode = name
	}
	st := checkpoint.State{Episode: r.Episode, PauseSeq: r.PauseSeq, RelayDelivered: r.RelayDelivered, RelayPosition: r.RelayPosition, HarnessSession: r.HarnessSession, Attempt: r.Attempt}
	if r.RestoresInPlace() {
		st.Identity, st.PauseWall, st.PauseUptime = *r.Identity, *r.PauseWall, *r.PauseUptime
		var e *episode.Episode
		var err error
		if name == "" {
			e, err = episode.ResumeInPlace(ctx, c.o.Env, spec, sb, st)
		} else {
			e, err = episode.ResumeCopy(ctx, c.o.Env, spec, sb, st, name)
		}
		if err == nil {
			cf := e.Clock()
			f.Resume, f.ResumeWhy, f.Clock = "in_place", "", &cf
			return e, f, nil
		}
		switch {
		case errors.Is(err, episode.ErrNotSameLaunch):
			f.ResumeWhy = err.Error()
		case errors.Is(err, checkpoint.ErrExited):
			// The recorded launch was in the fork, but its harness ended
			// before the continue could take effect (the fork still has
			// its files): relaunch it from its saved session there, as a
			// file-only snapshot would be, rather than fail every episode
			// of the restore.
			f.ResumeWhy = "the harness ended in the fork before the continue, so it is relaunched from its saved session: " + err.Error()
			if name != "" {
				// The copy's gateway registration and ledger exist already.
				spec.Name = name
				name = ""
			}
		default:
			return nil, f, err
		}
		c.log.Warn("resume in place impossible, relaunching", "episode", f.Episode, "why", f.ResumeWhy)
	} else if r.KeepsProcesses {
		f.ResumeWhy = "the record lacks the identity or the pause's clocks"
	}
	var e *episode.Episode
	var err error
	if name == "" {
		e, err = episode.RelaunchIn(ctx, c.o.Env, spec, sb, r.HarnessSession)
	} else {
		e, err = episode.RelaunchCopy(ctx, c.o.Env, spec, sb, r.HarnessSession, st.LedgerCut(), name)
	}
	return e, f, err
}
