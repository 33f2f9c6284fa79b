// Renders an Ollama TEMPLATE the way Ollama does, for tests/export/test_ollama.py to compare with the
// run's Jinja chat template.
//
// Reads JSON {"template": "...", "messages": [{"role": "...", "content": "..."}]} on stdin and writes the
// rendered prompt on stdout, nothing added. What the template sees follows Ollama's template/template.go
// (Execute and collate), restated here rather than imported (Ollama is not a dependency):
//   - .System: the contents of every system message, joined by a blank line;
//   - .Messages: every message, system ones included, where consecutive messages of one role (other than
//     "tool") are merged into one, their contents joined by a blank line;
//   - missing keys render as their zero value (Option("missingkey=zero")), and .Response is "".
//
// Only the standard library, for Go 1.19 and later: `go build main.go` needs no module.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/template"
)

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type request struct {
	Template string    `json:"template"`
	Messages []message `json:"messages"`
}

// collate gives Ollama's .System and .Messages for a conversation.
func collate(messages []message) (string, []*message) {
	var system []string
	var collated []*message
	for i := range messages {
		current := messages[i]
		if current.Role == "system" {
			system = append(system, current.Content)
		}
		if n := len(collated); n > 0 && collated[n-1].Role == current.Role && current.Role != "tool" {
			collated[n-1].Content += "\n\n" + current.Content
		} else {
			collated = append(collated, &current)
		}
	}
	return strings.Join(system, "\n\n"), collated
}

func main() {
	var req request
	if err := json.NewDecoder(os.Stdin).Decode(&req); err != nil {
		fmt.Fprintln(os.Stderr, "reading the request:", err)
		os.Exit(2)
	}
	// Ollama renders a template that never reads .Messages the legacy way (.Prompt, .Response per turn);
	// every TEMPLATE the export writes reads .Messages.
	if !strings.Contains(req.Template, ".Messages") {
		fmt.Fprintln(os.Stderr, "the template never reads .Messages: Ollama would render it the legacy way")
		os.Exit(2)
	}
	tmpl, err := template.New("").Option("missingkey=zero").Parse(req.Template)
	if err != nil {
		fmt.Fprintln(os.Stderr, "parsing the template:", err)
		os.Exit(1)
	}
	system, messages := collate(req.Messages)
	values := map[string]any{
		"System":   system,
		"Messages": messages,
		"Response": "",
	}
	if err := tmpl.Execute(os.Stdout, values); err != nil {
		fmt.Fprintln(os.Stderr, "executing the template:", err)
		os.Exit(1)
	}
}
