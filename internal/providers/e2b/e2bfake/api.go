package e2bfake

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/strictjson"
	"stasis/sandbox"
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

// decode reads a JSON request body, answering 400 as E2B's request
// validation does for one that is not JSON of the right types, or that is
// missing when the specification requires it.
func decode(w http.ResponseWriter, r *http.Request, v any, required bool) bool {
	b, err := io.ReadAll(r.Body)
	if err == nil && len(bytes.TrimSpace(b)) == 0 {
		err = io.EOF
	}
	if err == nil {
		err = strictjson.Unmarshal(b, v)
	}
	switch {
	case err == nil, !required && err == io.EOF:
		return true
	case err == io.EOF:
		writeError(w, http.StatusBadRequest, "request body has an error: value is required but missing")
	default:
		writeError(w, http.StatusBadRequest, "Error when parsing request: "+err.Error())
	}
	return false
}

// seconds checks a timeout member: required or not, at least 0 (and an
// int32, its format).
func seconds(w http.ResponseWriter, v *int64, required bool) (int64, bool) {
	switch {
	case v == nil && required:
		writeError(w, http.StatusBadRequest, `request body has an error: property "timeout" is missing`)
		return 0, false
	case v == nil:
		return 15, true
	case *v < 0 || *v > math.MaxInt32:
		writeError(w, http.StatusBadRequest, fmt.Sprintf("request body has an error: timeout %d is out of range (0 to %d)", *v, math.MaxInt32))
		return 0, false
	}
	return *v, true
}

func (f *Server) sandboxOf(sb *sbx) sandboxJSON {
	return sandboxJSON{TemplateID: sb.template, SandboxID: sb.id, ClientID: clientID, EnvdVersion: envdVersion, EnvdAccessToken: sb.token}
}

func (f *Server) listedOf(sb *sbx) listedJSON {
	state := stateRunning
	if sb.state == statePaused || sb.state == statePausing {
		state = statePaused
	}
	return listedJSON{
		TemplateID: sb.template, SandboxID: sb.id, ClientID: clientID, StartedAt: sb.startedAt, EndAt: sb.endAt,
		EnvdVersion: envdVersion, CPUCount: 2, MemoryMB: 512, DiskSizeMB: 1024, Metadata: sb.metadata, State: state,
	}
}

func (f *Server) detailOf(sb *sbx) detailJSON {
	return detailJSON{listedJSON: f.listedOf(sb), EnvdAccessToken: sb.token}
}

// create is POST /sandboxes: from a template, or from a snapshot's.
func (f *Server) create(w http.ResponseWriter, r *http.Request) {
	var body newSandboxBody
	if !decode(w, r, &body, true) {
		return
	}
	if body.TemplateID == nil || *body.TemplateID == "" {
		writeError(w, http.StatusBadRequest, `request body has an error: property "templateID" is missing`)
		return
	}
	template := *body.TemplateID
	timeout, ok := seconds(w, body.Timeout, false)
	if !ok {
		return
	}
	backendSnap, env, ok := f.template(w, template)
	if !ok {
		return
	}
	for k, v := range body.EnvVars {
		env[k] = v
	}
	id := newID()
	info, err := f.backendSandbox(r.Context(), id, backendSnap)
	if errors.Is(err, errdefs.ErrNotFound) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("template '%s' not found", template))
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, "Failed to create sandbox: "+err.Error())
		return
	}
	now := f.now()
	sb := &sbx{
		id: id, template: template, state: stateRunning, backend: info.ID,
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
	out := f.sandboxOf(sb)
	f.mu.Unlock()
	writeJSON(w, http.StatusCreated, out)
}

// template finds what a sandbox is made from: a snapshot's template (its
// backend snapshot and environment; an injected fork failure answers
// 500) or a base template of the options (no snapshot). The answer is
// written when it is neither.
func (f *Server) template(w http.ResponseWriter, template string) (backendSnap string, env map[string]string, ok bool) {
	tid := templateID(template)
	env = map[string]string{}
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		writeError(w, http.StatusServiceUnavailable, "the fake is closed")
		return "", nil, false
	}
	t, ok := f.tmpls[tid]
	if !ok || t.deleted {
		f.mu.Unlock()
		if !slices.Contains(f.o.Templates, tid) {
			writeError(w, http.StatusNotFound, fmt.Sprintf("template '%s' not found", template))
			return "", nil, false
		}
		return "", env, true
	}
	if ff, ok := f.forkFaults[tid]; ok {
		n := ff.seen
		ff.seen++
		if n == ff.k {
			f.mu.Unlock()
			writeError(w, http.StatusInternalServerError, fmt.Sprintf("injected failure of sandbox %d made from snapshot %s", n, template))
			return "", nil, false
		}
	}
	for k, v := range t.env {
		env[k] = v
	}
	backendSnap = t.backend
	f.mu.Unlock()
	return backendSnap, env, true
}

// backendSandbox makes the backend's sandbox for sandbox id: a fork of
// backendSnap (its clock set to the host's), or a new one.
func (f *Server) backendSandbox(ctx context.Context, id, backendSnap string) (sandbox.Info, error) {
	lease := f.now().Add(f.o.Lease)
	labels := map[string]string{"e2bfake": id}
	if backendSnap == "" {
		return f.b.Create(ctx, sandbox.Spec{Labels: labels, Expiry: lease, Image: f.o.Image})
	}
	infos, err := f.b.Fork(ctx, backendSnap, 1, sandbox.ForkSpec{Labels: labels, Expiry: lease})
	if err != nil {
		return sandbox.Info{}, err
	}
	info := infos[0]
	if err := f.hostClock(ctx, info.ID); err != nil {
		_ = f.b.Delete(context.Background(), info.ID)
		return info, err
	}
	return info, nil
}

func (f *Server) get(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	sb, ok := f.sbs[r.PathValue("id")]
	var d detailJSON
	if ok {
		d = f.detailOf(sb)
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
	states := []string{stateRunning, statePaused}
	if s := q.Get("state"); s != "" {
		states = strings.Split(s, ",")
		for _, st := range states {
			if st != stateRunning && st != statePaused {
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
	var all []listedJSON
	for _, sb := range f.sbs {
		d := f.listedOf(sb)
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
	all = page(w, all, func(d listedJSON) (time.Time, string) { return d.StartedAt, d.SandboxID }, limit, after, afterID)
	if all == nil {
		all = []listedJSON{}
	}
	writeJSON(w, http.StatusOK, all)
}

// page is one page of a list: items sorted newest first (by their key's
// time, then id, descending), those from the cursor (after, afterID) on,
// at most limit of them; the next page's token is set when more are left.
func page[T any](w http.ResponseWriter, items []T, key func(T) (time.Time, string), limit int, after time.Time, afterID string) []T {
	sort.Slice(items, func(i, j int) bool {
		ti, idi := key(items[i])
		tj, idj := key(items[j])
		if !ti.Equal(tj) {
			return ti.After(tj)
		}
		return idi > idj
	})
	if !after.IsZero() {
		i := sort.Search(len(items), func(i int) bool {
			t, id := key(items[i])
			return t.Before(after) || (t.Equal(after) && id < afterID)
		})
		items = items[i:]
	}
	if len(items) > limit {
		t, id := key(items[limit-1])
		w.Header().Set(headerNextToken, cursor(t, id))
		items = items[:limit]
	}
	return items
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
	case !ok || sb.state == statePaused:
		writeError(w, http.StatusNotFound, fmt.Sprintf("sandbox \"%s\" doesn't exist or you don't have access to it", id))
		return nil, false
	case sb.state != stateRunning:
		writeError(w, http.StatusConflict, fmt.Sprintf("sandbox \"%s\" is changing state (%s), try again later", id, sb.state))
		return nil, false
	}
	return sb, true
}

// timeoutSeconds reads a body of one required timeout (setTimeout's and
// connect's).
func timeoutSeconds(w http.ResponseWriter, r *http.Request) (int64, bool) {
	var body timeoutBody
	if !decode(w, r, &body, true) {
		return 0, false
	}
	return seconds(w, body.Timeout, true)
}

// setTimeout is POST /sandboxes/{id}/timeout: the end moves to now +
// timeout, earlier or later.
func (f *Server) setTimeout(w http.ResponseWriter, r *http.Request) {
	secs, ok := timeoutSeconds(w, r)
	if !ok {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.runningLocked(w, r.PathValue("id"))
	if !ok {
		return
	}
	now := f.now()
	sb.endAt = now.Add(time.Duration(secs) * time.Second).UTC()
	if !f.ignoreTimeouts {
		f.armLocked(sb, now)
	}
	w.WriteHeader(http.StatusNoContent)
}

// pause is POST /sandboxes/{id}/pause: the backend sandbox is snapshotted
// and deleted; its processes end (the backend's snapshots keep files only).
func (f *Server) pause(w http.ResponseWriter, r *http.Request) {
	var body pauseBody
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
	case sb.state == statePaused:
		f.mu.Unlock()
		writeError(w, http.StatusConflict, fmt.Sprintf("sandbox \"%s\" is already paused", id))
		return
	case sb.state != stateRunning:
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
			sb.state = stateRunning
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
	sb.state, sb.pausedSnap, sb.backend, sb.endAt = statePaused, snap.ID, "", f.now().UTC()
	sb.cancel()
	sb.procs = map[uint32]*process{}
	f.mu.Unlock()
	_ = f.b.Delete(context.Background(), backend)
	w.WriteHeader(http.StatusNoContent)
}

// connect is POST /sandboxes/{id}/connect: a running sandbox's end is only
// ever extended (200); a paused one is resumed from its snapshot (201).
func (f *Server) connect(w http.ResponseWriter, r *http.Request) {
	secs, ok := timeoutSeconds(w, r)
	if !ok {
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
	end := now.Add(time.Duration(secs) * time.Second).UTC()
	switch sb.state {
	case stateRunning:
		if end.After(sb.endAt) {
			sb.endAt = end
			if !f.ignoreTimeouts {
				f.armLocked(sb, now)
			}
		}
		out := f.sandboxOf(sb)
		f.mu.Unlock()
		writeJSON(w, http.StatusOK, out)
		return
	case statePaused:
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
			sb.state = statePaused
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
	sb.state, sb.backend, sb.pausedSnap = stateRunning, infos[0].ID, ""
	sb.endAt = now.Add(time.Duration(secs) * time.Second).UTC()
	sb.ctx, sb.cancel = context.WithCancel(f.ctx)
	f.backendIDs[id] = append(f.backendIDs[id], infos[0].ID)
	if !f.ignoreTimeouts {
		f.armLocked(sb, now)
	}
	out := f.sandboxOf(sb)
	f.mu.Unlock()
	_ = f.b.DeleteSnapshot(context.Background(), snap)
	writeJSON(w, http.StatusCreated, out)
}

// snapshot is POST /sandboxes/{id}/snapshots: a new template whose
// sandboxes start from the backend's snapshot of this one (which runs on,
// its end unchanged).
func (f *Server) snapshot(w http.ResponseWriter, r *http.Request) {
	var body snapshotBody
	if !decode(w, r, &body, true) {
		return
	}
	if body.Name != nil {
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
	writeJSON(w, http.StatusCreated, snapshotJSON{SnapshotID: t.id + ":default", Names: []string{}})
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
	ts = page(w, ts, func(t *tmpl) (time.Time, string) { return t.created, t.id }, limit, after, afterID)
	out := []snapshotJSON{}
	for _, t := range ts {
		out = append(out, snapshotJSON{SnapshotID: t.id + ":default", Names: []string{}})
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
