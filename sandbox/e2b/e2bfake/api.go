package e2bfake

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"stasis/errdefs"
	"stasis/sandbox"
	"stasis/sandbox/e2b/internal/wire"
)

const (
	clientID    = "6532622b"
	envdVersion = "0.2.0"
)

func (f *Server) routes() {
	f.api.HandleFunc("POST /sandboxes", f.create)
	f.api.HandleFunc("GET /v2/sandboxes", f.listSandboxes)
	f.api.HandleFunc("GET /sandboxes/{id}", f.get)
	f.api.HandleFunc("DELETE /sandboxes/{id}", f.kill)
	f.api.HandleFunc("POST /sandboxes/{id}/timeout", f.setTimeout)
	f.api.HandleFunc("POST /sandboxes/{id}/pause", f.pause)
	f.api.HandleFunc("POST /sandboxes/{id}/connect", f.connect)
	f.api.HandleFunc("POST /sandboxes/{id}/snapshots", f.snapshot)
	f.api.HandleFunc("GET /snapshots", f.listSnapshots)
	f.api.HandleFunc("DELETE /templates/{id}", f.deleteTemplate)
	f.api.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("the fake does not serve %s %s", r.Method, r.URL.Path))
	})
	f.envdRoutes()
}

func decode(w http.ResponseWriter, r *http.Request, v any, required bool) bool {
	err := json.NewDecoder(r.Body).Decode(v)
	if err == nil || (!required && err == io.EOF) {
		return true
	}
	writeError(w, http.StatusBadRequest, "Error when parsing request: "+err.Error())
	return false
}

func (f *Server) sandboxJSON(sb *sbx) wire.Sandbox {
	return wire.Sandbox{TemplateID: sb.template, SandboxID: sb.id, ClientID: clientID, EnvdVersion: envdVersion, EnvdAccessToken: sb.token}
}

func (f *Server) detailJSON(sb *sbx) wire.SandboxDetail {
	state := wire.StateRunning
	if sb.state == wire.StatePaused || sb.state == statePausing {
		state = wire.StatePaused
	}
	return wire.SandboxDetail{
		TemplateID: sb.template, SandboxID: sb.id, ClientID: clientID, StartedAt: sb.startedAt, EndAt: sb.endAt,
		EnvdVersion: envdVersion, EnvdAccessToken: sb.token, CPUCount: 2, MemoryMB: 512, DiskSizeMB: 1024,
		Metadata: sb.metadata, State: state,
	}
}

// create is POST /sandboxes: from a template, or from a snapshot's.
func (f *Server) create(w http.ResponseWriter, r *http.Request) {
	var body wire.NewSandbox
	if !decode(w, r, &body, true) {
		return
	}
	if body.TemplateID == "" {
		writeError(w, http.StatusBadRequest, "templateID is required")
		return
	}
	timeout := int32(15)
	if body.Timeout != nil {
		timeout = *body.Timeout
	}
	if timeout < 0 {
		writeError(w, http.StatusBadRequest, "timeout must not be negative")
		return
	}
	tid := templateID(body.TemplateID)
	env := map[string]string{}
	var backendSnap string
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		writeError(w, http.StatusServiceUnavailable, "the fake is closed")
		return
	}
	if t, ok := f.tmpls[tid]; ok && !t.deleted {
		if ff, ok := f.forkFaults[tid]; ok {
			n := ff.seen
			ff.seen++
			if n == ff.k {
				f.mu.Unlock()
				writeError(w, http.StatusInternalServerError, fmt.Sprintf("injected failure of sandbox %d made from snapshot %s", n, body.TemplateID))
				return
			}
		}
		backendSnap = t.backend
		for k, v := range t.env {
			env[k] = v
		}
	} else if !slices.Contains(f.o.Templates, tid) {
		f.mu.Unlock()
		writeError(w, http.StatusNotFound, fmt.Sprintf("template '%s' not found", body.TemplateID))
		return
	}
	f.mu.Unlock()
	for k, v := range body.EnvVars {
		env[k] = v
	}
	id := newID()
	var (
		info sandbox.Info
		err  error
	)
	lease := f.now().Add(f.o.Lease)
	labels := map[string]string{"e2bfake": id}
	if backendSnap != "" {
		var infos []sandbox.Info
		infos, err = f.b.Fork(r.Context(), backendSnap, 1, sandbox.ForkSpec{Labels: labels, Expiry: lease})
		if err == nil {
			info = infos[0]
			if err = f.hostClock(r.Context(), info.ID); err != nil {
				_ = f.b.Delete(context.Background(), info.ID)
			}
		}
	} else {
		info, err = f.b.Create(r.Context(), sandbox.Spec{Labels: labels, Expiry: lease, Image: f.o.Image})
	}
	if errors.Is(err, errdefs.ErrNotFound) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("template '%s' not found", body.TemplateID))
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, "Failed to create sandbox: "+err.Error())
		return
	}
	now := f.now()
	sb := &sbx{
		id: id, template: body.TemplateID, state: wire.StateRunning, backend: info.ID,
		metadata: body.Metadata, env: env, startedAt: now.UTC(), endAt: now.Add(time.Duration(timeout) * time.Second).UTC(),
		procs: map[uint32]*process{},
	}
	if body.Secure != nil && *body.Secure {
		sb.token = newID()
	}
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		_ = f.b.Delete(context.Background(), info.ID)
		writeError(w, http.StatusServiceUnavailable, "the fake is closed")
		return
	}
	sb.ctx, sb.cancel = context.WithCancel(f.ctx)
	f.sbs[id] = sb
	f.backendIDs[id] = append(f.backendIDs[id], info.ID)
	if !f.ignoreTimeouts {
		f.armLocked(sb, now)
	}
	out := f.sandboxJSON(sb)
	f.mu.Unlock()
	writeJSON(w, http.StatusCreated, out)
}

func (f *Server) get(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	sb, ok := f.sbs[r.PathValue("id")]
	var d wire.SandboxDetail
	if ok {
		d = f.detailJSON(sb)
	}
	f.mu.Unlock()
	if !ok {
		writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox \"%s\" doesn't exist or you don't have access to it", r.PathValue("id")))
		return
	}
	writeJSON(w, http.StatusOK, d)
}

// parseMetadataFilter parses the metadata filter as E2B does: the whole
// value unescaped, split on & and =, each part unescaped again.
func parseMetadataFilter(q string) (map[string]string, error) {
	q, err := url.QueryUnescape(q)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, kv := range strings.Split(q, "&") {
		parts := strings.Split(kv, "=")
		if len(parts) != 2 {
			return nil, errors.New("invalid key value pair in query")
		}
		k, err := url.QueryUnescape(parts[0])
		if err != nil {
			return nil, err
		}
		v, err := url.QueryUnescape(parts[1])
		if err != nil {
			return nil, err
		}
		out[k] = v
	}
	return out, nil
}

// pageParams reads limit (1..100, default 100; at most Options.PageLimit)
// and nextToken (a base64 cursor "time__id").
func (f *Server) pageParams(q url.Values) (limit int, after time.Time, afterID string, err error) {
	defer func() { limit = min(limit, f.o.PageLimit) }()
	limit = 100
	if s := q.Get("limit"); s != "" {
		if limit, err = strconv.Atoi(s); err != nil || limit < 1 || limit > 100 {
			return 0, time.Time{}, "", fmt.Errorf("limit must be 1 to 100")
		}
	}
	if tok := q.Get("nextToken"); tok != "" {
		b, err := base64.URLEncoding.DecodeString(tok)
		if err != nil {
			return 0, time.Time{}, "", fmt.Errorf("error decoding cursor: %v", err)
		}
		ts, id, ok := strings.Cut(string(b), "__")
		if !ok {
			return 0, time.Time{}, "", errors.New("invalid cursor format")
		}
		if after, err = time.Parse(time.RFC3339Nano, ts); err != nil {
			return 0, time.Time{}, "", fmt.Errorf("invalid timestamp format in cursor: %v", err)
		}
		afterID = id
	}
	return limit, after, afterID, nil
}

func cursor(t time.Time, id string) string {
	return base64.URLEncoding.EncodeToString([]byte(t.UTC().Format(time.RFC3339Nano) + "__" + id))
}

// listSandboxes is GET /v2/sandboxes: newest first, a page at a time.
func (f *Server) listSandboxes(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var filter map[string]string
	if m := q.Get("metadata"); m != "" {
		var err error
		if filter, err = parseMetadataFilter(m); err != nil {
			writeError(w, http.StatusBadRequest, "Error parsing metadata: "+err.Error())
			return
		}
	}
	states := []string{wire.StateRunning, wire.StatePaused}
	if s := q.Get("state"); s != "" {
		states = strings.Split(s, ",")
		for _, st := range states {
			if st != wire.StateRunning && st != wire.StatePaused {
				writeError(w, http.StatusBadRequest, fmt.Sprintf("invalid state %q", st))
				return
			}
		}
	}
	limit, after, afterID, err := f.pageParams(q)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	f.mu.Lock()
	var all []wire.ListedSandbox
	for _, sb := range f.sbs {
		d := f.detailJSON(sb)
		d.EnvdAccessToken = ""
		if !slices.Contains(states, d.State) {
			continue
		}
		match := true
		for k, v := range filter {
			if got, ok := sb.metadata[k]; !ok || got != v {
				match = false
			}
		}
		if match {
			all = append(all, d)
		}
	}
	f.mu.Unlock()
	sort.Slice(all, func(i, j int) bool {
		if !all[i].StartedAt.Equal(all[j].StartedAt) {
			return all[i].StartedAt.After(all[j].StartedAt)
		}
		return all[i].SandboxID > all[j].SandboxID
	})
	if !after.IsZero() {
		i := sort.Search(len(all), func(i int) bool {
			s := all[i]
			return s.StartedAt.Before(after) || (s.StartedAt.Equal(after) && s.SandboxID < afterID)
		})
		all = all[i:]
	}
	if len(all) > limit {
		last := all[limit-1]
		w.Header().Set(wire.NextTokenHeader, cursor(last.StartedAt, last.SandboxID))
		all = all[:limit]
	}
	if all == nil {
		all = []wire.ListedSandbox{}
	}
	writeJSON(w, http.StatusOK, all)
}

func (f *Server) kill(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !f.end(id, true) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox \"%s\" doesn't exist or you don't have access to it", id))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// running finds a running sandbox under f.mu, or answers as E2B does: 404
// for one it does not hold running (a paused one lives only as a snapshot),
// 409 for one changing state.
func (f *Server) runningLocked(w http.ResponseWriter, id string) (*sbx, bool) {
	sb, ok := f.sbs[id]
	switch {
	case !ok || sb.state == wire.StatePaused:
		writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox \"%s\" doesn't exist or you don't have access to it", id))
		return nil, false
	case sb.state != wire.StateRunning:
		writeError(w, http.StatusConflict, fmt.Sprintf("sandbox \"%s\" is changing state (%s), try again later", id, sb.state))
		return nil, false
	}
	return sb, true
}

// setTimeout is POST /sandboxes/{id}/timeout: the end moves to now +
// timeout, earlier or later.
func (f *Server) setTimeout(w http.ResponseWriter, r *http.Request) {
	var body wire.Timeout
	if !decode(w, r, &body, true) {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.runningLocked(w, r.PathValue("id"))
	if !ok {
		return
	}
	now := f.now()
	sb.endAt = now.Add(time.Duration(max(body.Timeout, 0)) * time.Second).UTC()
	if !f.ignoreTimeouts {
		f.armLocked(sb, now)
	}
	w.WriteHeader(http.StatusNoContent)
}

// pause is POST /sandboxes/{id}/pause: the backend sandbox is snapshotted
// and deleted; its processes end (the backend's snapshots keep files only).
func (f *Server) pause(w http.ResponseWriter, r *http.Request) {
	var body wire.PauseRequest
	if !decode(w, r, &body, false) {
		return
	}
	id := r.PathValue("id")
	f.mu.Lock()
	sb, ok := f.sbs[id]
	switch {
	case !ok:
		f.mu.Unlock()
		writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox \"%s\" doesn't exist or you don't have access to it", id))
		return
	case sb.state == wire.StatePaused:
		f.mu.Unlock()
		writeError(w, http.StatusConflict, fmt.Sprintf("sandbox \"%s\" is already paused", id))
		return
	case sb.state != wire.StateRunning:
		f.mu.Unlock()
		writeError(w, http.StatusConflict, fmt.Sprintf("sandbox \"%s\" is changing state (%s), try again later", id, sb.state))
		return
	}
	sb.state = statePausing
	if sb.timer != nil {
		sb.timer.Stop()
	}
	backend := sb.backend
	f.mu.Unlock()
	snap, err := f.b.Snapshot(r.Context(), backend, "")
	f.mu.Lock()
	if err != nil || f.sbs[id] != sb {
		if f.sbs[id] == sb {
			sb.state = wire.StateRunning
			if !f.ignoreTimeouts {
				f.armLocked(sb, f.now())
			}
		}
		f.mu.Unlock()
		if err == nil {
			_ = f.b.DeleteSnapshot(context.Background(), snap.ID)
			err = errors.New("it was deleted while pausing")
		}
		writeError(w, http.StatusInternalServerError, "Error pausing sandbox: "+err.Error())
		return
	}
	sb.state, sb.pausedSnap, sb.backend, sb.endAt = wire.StatePaused, snap.ID, "", f.now().UTC()
	sb.cancel()
	sb.procs = map[uint32]*process{}
	f.mu.Unlock()
	_ = f.b.Delete(context.Background(), backend)
	w.WriteHeader(http.StatusNoContent)
}

// connect is POST /sandboxes/{id}/connect: a running sandbox's end is only
// ever extended (200); a paused one is resumed from its snapshot (201).
func (f *Server) connect(w http.ResponseWriter, r *http.Request) {
	var body wire.Timeout
	if !decode(w, r, &body, true) {
		return
	}
	id := r.PathValue("id")
	f.mu.Lock()
	sb, ok := f.sbs[id]
	if !ok {
		f.mu.Unlock()
		writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox \"%s\" doesn't exist or you don't have access to it", id))
		return
	}
	now := f.now()
	end := now.Add(time.Duration(max(body.Timeout, 0)) * time.Second).UTC()
	switch sb.state {
	case wire.StateRunning:
		if end.After(sb.endAt) {
			sb.endAt = end
			if !f.ignoreTimeouts {
				f.armLocked(sb, now)
			}
		}
		out := f.sandboxJSON(sb)
		f.mu.Unlock()
		writeJSON(w, http.StatusOK, out)
		return
	case wire.StatePaused:
	default:
		f.mu.Unlock()
		writeError(w, http.StatusConflict, fmt.Sprintf("sandbox \"%s\" is changing state (%s), try again later", id, sb.state))
		return
	}
	sb.state = stateResuming
	snap := sb.pausedSnap
	f.mu.Unlock()
	infos, err := f.b.Fork(r.Context(), snap, 1, sandbox.ForkSpec{Labels: map[string]string{"e2bfake": id}, Expiry: f.now().Add(f.o.Lease)})
	if err == nil {
		if err = f.hostClock(r.Context(), infos[0].ID); err != nil {
			_ = f.b.Delete(context.Background(), infos[0].ID)
		}
	}
	f.mu.Lock()
	if err != nil || f.sbs[id] != sb {
		if f.sbs[id] == sb {
			sb.state = wire.StatePaused
		}
		f.mu.Unlock()
		if err == nil {
			_ = f.b.Delete(context.Background(), infos[0].ID)
			err = errors.New("it was deleted while resuming")
		}
		writeError(w, http.StatusInternalServerError, "Error resuming sandbox: "+err.Error())
		return
	}
	now = f.now()
	sb.state, sb.backend, sb.pausedSnap = wire.StateRunning, infos[0].ID, ""
	sb.endAt = now.Add(time.Duration(max(body.Timeout, 0)) * time.Second).UTC()
	sb.ctx, sb.cancel = context.WithCancel(f.ctx)
	f.backendIDs[id] = append(f.backendIDs[id], infos[0].ID)
	if !f.ignoreTimeouts {
		f.armLocked(sb, now)
	}
	out := f.sandboxJSON(sb)
	f.mu.Unlock()
	_ = f.b.DeleteSnapshot(context.Background(), snap)
	writeJSON(w, http.StatusCreated, out)
}

// snapshot is POST /sandboxes/{id}/snapshots: a new template whose
// sandboxes start from the backend's snapshot of this one (which runs on,
// its end unchanged).
func (f *Server) snapshot(w http.ResponseWriter, r *http.Request) {
	var body wire.SnapshotRequest
	if !decode(w, r, &body, false) {
		return
	}
	if body.Name != "" {
		writeError(w, http.StatusBadRequest, "the fake does not name snapshots")
		return
	}
	id := r.PathValue("id")
	f.mu.Lock()
	sb, ok := f.runningLocked(w, id)
	if !ok {
		f.mu.Unlock()
		return
	}
	backend := sb.backend
	env := map[string]string{}
	for k, v := range sb.env {
		env[k] = v
	}
	f.mu.Unlock()
	snap, err := f.b.Snapshot(r.Context(), backend, "")
	if errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errdefs.ErrExpired) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox \"%s\" doesn't exist or you don't have access to it", id))
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, "Error creating snapshot template: "+err.Error())
		return
	}
	t := &tmpl{id: newID(), backend: snap.ID, env: env, source: id, created: f.now().UTC()}
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		_ = f.b.DeleteSnapshot(context.Background(), snap.ID)
		writeError(w, http.StatusServiceUnavailable, "the fake is closed")
		return
	}
	f.tmpls[t.id] = t
	f.mu.Unlock()
	writeJSON(w, http.StatusCreated, wire.SnapshotInfo{SnapshotID: t.id + ":default", Names: []string{}})
}

// listSnapshots is GET /snapshots, filtered by sandboxID and name (a
// template id, with or without its tag).
func (f *Server) listSnapshots(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit, after, afterID, err := f.pageParams(q)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	name, source := q.Get("name"), q.Get("sandboxID")
	f.mu.Lock()
	var ts []*tmpl
	for _, t := range f.tmpls {
		if t.deleted || (source != "" && t.source != source) || (name != "" && templateID(name) != t.id) {
			continue
		}
		ts = append(ts, t)
	}
	f.mu.Unlock()
	sort.Slice(ts, func(i, j int) bool {
		if !ts[i].created.Equal(ts[j].created) {
			return ts[i].created.After(ts[j].created)
		}
		return ts[i].id > ts[j].id
	})
	if !after.IsZero() {
		i := sort.Search(len(ts), func(i int) bool {
			return ts[i].created.Before(after) || (ts[i].created.Equal(after) && ts[i].id < afterID)
		})
		ts = ts[i:]
	}
	if len(ts) > limit {
		w.Header().Set(wire.NextTokenHeader, cursor(ts[limit-1].created, ts[limit-1].id))
		ts = ts[:limit]
	}
	out := []wire.SnapshotInfo{}
	for _, t := range ts {
		out = append(out, wire.SnapshotInfo{SnapshotID: t.id + ":default", Names: []string{}})
	}
	writeJSON(w, http.StatusOK, out)
}

// deleteTemplate is DELETE /templates/{id}: a snapshot's template goes;
// sandboxes made from it run on.
func (f *Server) deleteTemplate(w http.ResponseWriter, r *http.Request) {
	tid := templateID(r.PathValue("id"))
	f.mu.Lock()
	t, ok := f.tmpls[tid]
	if !ok || t.deleted {
		f.mu.Unlock()
		writeError(w, http.StatusNotFound, fmt.Sprintf("template '%s' not found", r.PathValue("id")))
		return
	}
	t.deleted = true
	backend := t.backend
	f.mu.Unlock()
	if err := f.b.DeleteSnapshot(r.Context(), backend); err != nil {
		writeError(w, http.StatusInternalServerError, "Error deleting template: "+err.Error())
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
