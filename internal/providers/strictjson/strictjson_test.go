package strictjson

import (
	"strings"
	"testing"
)

func TestUnmarshal(t *testing.T) {
	type inner struct {
		PID *uint32 `json:"pid"`
	}
	type base struct {
		Tag string `json:"tag"`
	}
	type body struct {
		base
		TemplateID string            `json:"templateID"`
		Process    inner             `json:"process"`
		List       []inner           `json:"list"`
		Labels     map[string]string `json:"labels"`
		Plain      int
	}
	var b body
	if err := Unmarshal([]byte(`{"templateID": "t", "tag": "x", "process": {"pid": 1}, "list": [{"pid": 2}], "labels": {"TemplateId": "v"}, "Plain": 3, "unknown": 1}`), &b); err != nil {
		t.Fatalf("exact names (unknown members and map keys are not its business): %v", err)
	}
	if b.TemplateID != "t" || b.Tag != "x" || *b.Process.PID != 1 || *b.List[0].PID != 2 || b.Plain != 3 {
		t.Fatalf("decoded %+v", b)
	}
	for in, want := range map[string]string{
		`{"templateId": "t"}`:                `"templateId"`,
		`{"TAG": "x"}`:                       `"TAG"`,
		`{"process": {"PID": 1}}`:            `"process.PID"`,
		`{"list": [{"pid": 1}, {"Pid": 2}]}`: `"list[1].Pid"`,
		`{"plain": 3}`:                       `"plain"`,
	} {
		var b body
		if err := Unmarshal([]byte(in), &b); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error naming %s", in, err, want)
		}
	}
}
