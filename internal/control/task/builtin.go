package task

import (
	"embed"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"sync"
)

// builtinFS holds the built-in tasks, one directory each (LoadFS's layout).
// The directory starts with '_' so that the Go tool does not build the Go
// tasks' code as part of stasis.
//
//go:embed all:_builtin
var builtinFS embed.FS

var builtin = sync.OnceValues(func() ([]*Task, error) {
	ents, err := fs.ReadDir(builtinFS, "_builtin")
	if err != nil {
		return nil, err
	}
	var ts []*Task
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		t, err := LoadFS(builtinFS, "_builtin/"+e.Name())
		if err != nil {
			return nil, fmt.Errorf("built-in %w", err)
		}
		if t.ID != e.Name() {
			return nil, fmt.Errorf("built-in task in %s has id %q: the directory must be named after the id", e.Name(), t.ID)
		}
		ts = append(ts, t)
	}
	sort.Slice(ts, func(i, j int) bool { return ts[i].ID < ts[j].ID })
	return ts, nil
})

// Builtin returns the built-in tasks, sorted by id. They are shared: do not
// modify them.
func Builtin() ([]*Task, error) { return builtin() }

// Lookup finds a task by id among ts.
func Lookup(ts []*Task, id string) (*Task, error) {
	for _, t := range ts {
		if t.ID == id {
			return t, nil
		}
	}
	ids := make([]string, 0, len(ts))
	for _, t := range ts {
		ids = append(ids, t.ID)
	}
	return nil, fmt.Errorf("no task %q; the tasks are: %v", id, ids)
}

// Load reads tasks named on a command line: "builtin" for the built-in set;
// a directory holding task.json for one task; a directory of such
// directories for all of them; or a SWE-bench JSONL file, whose instances
// are loaded from the repositories under o.Repos (see LoadSWEBench).
// Instances that cannot be loaded are returned as problems, not as an
// error, so that the rest can run.
func Load(spec string, o SWEBenchOptions) (ts []*Task, problems []error, err error) {
	if spec == "" || spec == "builtin" {
		ts, err := Builtin()
		return ts, nil, err
	}
	st, err := os.Stat(spec)
	if err != nil {
		return nil, nil, fmt.Errorf("tasks %s: %w (give builtin, a task directory, or a SWE-bench JSONL file)", spec, err)
	}
	if !st.IsDir() {
		return LoadSWEBench(spec, o)
	}
	if _, err := os.Stat(filepath.Join(spec, "task.json")); err == nil {
		t, err := LoadDir(spec)
		if err != nil {
			return nil, nil, err
		}
		return []*Task{t}, nil, nil
	}
	ents, err := os.ReadDir(spec)
	if err != nil {
		return nil, nil, err
	}
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		if _, err := os.Stat(filepath.Join(spec, e.Name(), "task.json")); err != nil {
			continue
		}
		t, err := LoadDir(filepath.Join(spec, e.Name()))
		if err != nil {
			problems = append(problems, err)
			continue
		}
		ts = append(ts, t)
	}
	if len(ts) == 0 && len(problems) == 0 {
		return nil, nil, fmt.Errorf("tasks %s: no task.json in it or in its subdirectories", spec)
	}
	return ts, problems, nil
}
