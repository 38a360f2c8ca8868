package task

import (
	"encoding/json"
	"fmt"
	"path"
	"strings"
	"unicode/utf8"

	"stasis/internal/control/model"
)

// Prompt is what a harness is asked: the problem statement, then where the
// work tree is and how the tests run.
func (t *Task) Prompt() string {
	return strings.TrimSpace(t.Statement) + "\n\n" +
		"The repository is in " + WorkDir + ". Fix the problem in the code (not in the tests); " +
		"the tests run with: " + t.TestCmd + "\n"
}

// matchLen is how much of the statement selects a task's script.
const matchLen = 200

// ScriptMatch is the text whose presence in a user message selects the
// task's script: the start of its trimmed statement.
func (t *Task) ScriptMatch() string {
	s := strings.TrimSpace(t.Statement)
	if len(s) <= matchLen {
		return s
	}
	cut := matchLen
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

// call is a tool call in the mini harness's names, with OpenCode's as the
// alternative.
func call(name string, args map[string]any, ocName string, ocArgs map[string]any) model.ScriptCall {
	a, _ := json.Marshal(args)
	oa, _ := json.Marshal(ocArgs)
	return model.ScriptCall{Name: name, Arguments: a, Alternatives: []model.ToolAlt{{Name: ocName, Arguments: oa}}}
}

func runCall(command, description string) model.ScriptCall {
	return call("run", map[string]any{"command": command}, "bash", map[string]any{"command": command, "description": description})
}

// Script is the scripted model's play for the task: look at the work tree,
// read each file the reference solution changes, write the fixed files (or
// apply the reference patch), run the tests, and answer, one step per model
// call, so that a checkpoint can fall between any two. Its tool calls name
// the mini harness's tools with OpenCode's as alternatives. It fails for a
// task without a reference solution.
func (t *Task) Script() (*model.Script, error) {
	if t.Solution == nil || (len(t.Solution.Files) == 0 && t.Solution.Patch == "") {
		return nil, fmt.Errorf("task %s has no reference solution: the scripted model cannot solve it", t.ID)
	}
	s := &model.Script{Name: t.ID, Match: t.ScriptMatch()}
	s.Turns = append(s.Turns, model.Turn{
		Content:   "Let me look at the repository first.",
		ToolCalls: []model.ScriptCall{runCall("ls -R "+WorkDir+" | head -100", "List the files of the repository")},
	})
	if len(t.Solution.Files) > 0 {
		paths := t.Solution.Paths()
		for _, p := range paths {
			abs := path.Join(WorkDir, p)
			s.Turns = append(s.Turns, model.Turn{ToolCalls: []model.ScriptCall{
				call("read_file", map[string]any{"path": p}, "read", map[string]any{"filePath": abs}),
			}})
		}
		for i, p := range paths {
			abs := path.Join(WorkDir, p)
			content := string(t.Solution.Files[p])
			turn := model.Turn{ToolCalls: []model.ScriptCall{
				call("write_file", map[string]any{"path": p, "content": content}, "write", map[string]any{"filePath": abs, "content": content}),
			}}
			if i == 0 {
				turn.Content = "I see the bug; here is the fix."
			}
			s.Turns = append(s.Turns, turn)
		}
	} else {
		patch := t.Solution.Patch
		if !strings.HasSuffix(patch, "\n") {
			patch += "\n"
		}
		const eof = "STASIS_PATCH_EOF"
		cmd := "cd " + WorkDir + " && git apply - <<'" + eof + "'\n" + patch + eof
		s.Turns = append(s.Turns, model.Turn{
			Content:   "I see the bug; here is the fix.",
			ToolCalls: []model.ScriptCall{runCall(cmd, "Apply the fix")},
		})
	}
	s.Turns = append(s.Turns,
		model.Turn{Content: "Now the tests.", ToolCalls: []model.ScriptCall{runCall(t.TestCmd, "Run the tests")}},
		model.Turn{Content: "Fixed: " + oneLine(t.Title) + ". The tests pass."},
	)
	b, err := json.Marshal(s)
	if err != nil {
		return nil, err
	}
	return model.ParseScript(b) // validates and normalises
}

func oneLine(s string) string {
	s = strings.TrimSpace(strings.SplitN(s, "\n", 2)[0])
	if s == "" {
		return "the problem"
	}
	return s
}

// Scripts are the scripts of every task that has a reference solution.
func Scripts(ts []*Task) ([]*model.Script, error) {
	var out []*model.Script
	seen := map[string]string{}
	for _, t := range ts {
		if t.Solution == nil {
			continue
		}
		s, err := t.Script()
		if err != nil {
			return nil, err
		}
		if other, dup := seen[s.Match]; dup {
			return nil, fmt.Errorf("tasks %s and %s begin their statements alike: the scripted model could not tell them apart", other, t.ID)
		}
		seen[s.Match] = t.ID
		out = append(out, s)
	}
	return out, nil
}
