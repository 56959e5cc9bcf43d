//! `shallot chat`: prompts through the filters to the model, each a whole
//! agent turn with the built-in tools.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

use async_trait::async_trait;
use clap::Args;
use serde_json::{Value, json};
use shallot::types::{
    Content, ContentPart, FinishReason, Message, Token, ToolRequest, ToolResponse, TurnDone,
    TurnRequest, TurnResult,
};
use shallot::{
    ApprovalRequest, Approver, ChainError, Config, Context, EmbeddedModel, Engine, Filter, Hook,
    InvokeOptions, Kernel, LoopConfig, McpServer, MemoryHistory, Next, NoHistory, Tool, ToolLoop,
};

use super::{ModelArgs, Source};

#[derive(Args)]
pub(crate) struct ChatArgs {
    #[command(flatten)]
    source: Source,
    /// Stream each answer token by token, through the filters' token transforms.
    #[arg(long)]
    stream: bool,
    /// Print each turn's result as a JSON object instead of its text (its
    /// texts as the token transforms show them; a failed turn fails the
    /// command).
    #[arg(long)]
    json: bool,
    /// Keep the prompts' history under this conversation id (the prompts of
    /// one run always share a conversation).
    #[arg(long, value_name = "ID", default_value = "cli")]
    conversation: String,
    /// A system prompt for every turn (repeatable; filters with a
    /// system-prompt hook may reshape it).
    #[arg(long, value_name = "TEXT")]
    system: Vec<String>,
    /// Offer the model no tools (by default: calculator, clock, echo).
    #[arg(long)]
    no_tools: bool,
    /// Model rounds one turn may take.
    #[arg(long, value_name = "N", default_value_t = 10)]
    max_iterations: u32,
    /// Refuse a call to a tool the model was not offered in that round (as
    /// the filters left the list): trimming the tools becomes access
    /// control. By default a registered tool the model names runs.
    #[arg(long)]
    offered_only: bool,
    /// End a turn when every tool call of a round was refused (by
    /// approval, a guard or a filter) instead of asking the model again.
    #[arg(long)]
    stop_on_all_denied: bool,
    /// Pause between the embedded model's streamed tokens, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pace: u64,
    #[command(flatten)]
    model: ModelArgs,
    /// The prompts, sent one after another as turns of one conversation.
    /// Without any, prompts are read from stdin, one per line: a REPL on a
    /// terminal (Ctrl-D ends it), or a script from a pipe.
    #[arg(value_name = "PROMPT")]
    prompts: Vec<String>,
}

/// Where the prompts come from: the command line, or stdin line by line.
enum Prompts {
    Given(std::vec::IntoIter<String>),
    Stdin { interactive: bool },
}

impl Prompts {
    fn new(given: Vec<String>) -> Self {
        if given.is_empty() {
            let interactive = std::io::stdin().is_terminal();
            if interactive {
                eprintln!("shallot chat: one prompt per line; Ctrl-D ends the conversation");
            }
            Prompts::Stdin { interactive }
        } else {
            Prompts::Given(given.into_iter())
        }
    }

    /// The next prompt; blank lines are skipped.
    async fn next(&mut self) -> anyhow::Result<Option<String>> {
        match self {
            Prompts::Given(prompts) => Ok(prompts.next()),
            Prompts::Stdin { interactive } => loop {
                if *interactive {
                    eprint!("> ");
                }
                match read_line().await? {
                    None => return Ok(None),
                    Some(line) if line.trim().is_empty() => continue,
                    Some(line) => return Ok(Some(line.trim_end_matches(['\r', '\n']).to_owned())),
                }
            },
        }
    }
}

pub(crate) async fn run(engine: &Engine, mut args: ChatArgs) -> anyhow::Result<ExitCode> {
    let kernel = kernel(engine, &args).await?;
    let several = args.prompts.len() > 1;
    let mut failed = false;
    let mut prompts = Prompts::new(std::mem::take(&mut args.prompts));
    while let Some(prompt) = prompts.next().await? {
        if several && !args.json {
            println!("> {prompt}");
        }
        failed |= ask(&kernel, &args, &prompt).await?;
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The kernel `shallot chat` runs: the configured filters, the model, the
/// built-in tools unless left out, and in a terminal, the approver.
async fn kernel(engine: &Engine, args: &ChatArgs) -> anyhow::Result<Kernel> {
    let file = args.source.config()?;
    let plugins = args.source.load(engine, file.as_ref()).await?;
    let config = LoopConfig {
        max_iterations: args.max_iterations,
        offered_only: args.offered_only,
        stop_on_all_denied: args.stop_on_all_denied,
        ..LoopConfig::default()
    };
    let tool_loop = if plugins.keeps_conversations() {
        ToolLoop::new(config, NoHistory)
    } else {
        ToolLoop::new(config, MemoryHistory::default())
    };
    let mut builder = Kernel::builder().plugins(&plugins).turn_terminal(tool_loop);
    builder = match args.model.server(file.as_ref())? {
        Some(server) => builder.model(server.connect()?),
        None => builder.model(EmbeddedModel::new().with_delay(Duration::from_millis(args.pace))),
    };
    if !args.no_tools {
        builder = builder.builtin_tools();
        let servers = file.as_ref().map(Config::mcp).transpose()?;
        for server in servers.unwrap_or_default() {
            eprintln!("starting the MCP server '{}' ...", server.name);
            let server = McpServer::start(server).await?;
            eprintln!("  {} tools", server.tools().len());
            builder = builder.mcp(&server);
        }
    }
    if !args.json {
        builder = builder.filter(ShowTools);
    }
    if std::io::stdin().is_terminal() && std::io::stderr().is_terminal() {
        builder = builder.approver(TerminalApprover::default());
    }
    Ok(builder.build()?)
}

/// Runs one prompt as a turn and shows its result; `true` when it failed
/// in `--json` mode (where a failure is a line, not the end).
async fn ask(kernel: &Kernel, args: &ChatArgs, prompt: &str) -> anyhow::Result<bool> {
    let context = Context::new().with(shallot::CONVERSATION_ID, args.conversation.as_str());
    let options = args
        .system
        .iter()
        .fold(InvokeOptions::from(context.clone()), |options, prompt| {
            options.system_prompt(prompt.as_str())
        });
    let request = TurnRequest::new(vec![Message::user(prompt)]);
    // What is shown goes through the token transforms, streamed or not,
    // so a redaction filter holds in every output mode: the answer within
    // its turn (streamed, or a filter's answer streamed at its end, or
    // returned as shown), the `--json` line's other texts after it.
    let result = if args.json {
        kernel.turn(request, options).await
    } else if args.stream {
        let sink = move |token: Token<'_>| {
            print!("{}", for_stdout(token.text));
            let _ = std::io::stdout().flush();
        };
        kernel.turn_stream(request, options.shown(), sink).await
    } else {
        kernel.turn(request, options.shown()).await
    };
    if args.json {
        let shown = Shown { kernel, context };
        println!("{}", shallot::json_line(&to_json(&result, &shown).await?));
        return Ok(matches!(result, TurnResult::Error(_)));
    }
    match result {
        TurnResult::Done(done) => {
            if !args.stream {
                print!("{}", for_stdout(&done.response.text()));
            }
            println!();
            if done.response.finish_reason != FinishReason::Complete {
                eprintln!("[finish reason: {}]", name(&done.response.finish_reason));
            }
        }
        TurnResult::Interrupt(interrupt) => {
            println!("[interrupted: {}]", for_stdout(&interrupt.reason));
        }
        TurnResult::Error(error) => return Err(anyhow::anyhow!("{error}")),
    }
    Ok(false)
}

/// Text as the person running the command is shown it: through the
/// kernel's token transforms, in the turn's context.
struct Shown<'a> {
    kernel: &'a Kernel,
    context: Context,
}

impl Shown<'_> {
    async fn text(&self, text: &str) -> Result<String, ChainError> {
        self.kernel.delivered_text(text, self.context.clone()).await
    }

    async fn message(&self, message: &Message) -> Result<Message, ChainError> {
        let mut shown = message.clone();
        match &mut shown.content {
            Some(Content::Text(text)) => *text = self.text(text).await?,
            Some(Content::Parts(parts)) => {
                for part in parts {
                    if let ContentPart::Text { text } = part {
                        *text = self.text(text).await?;
                    }
                }
            }
            None => {}
        }
        Ok(shown)
    }
}

fn name(value: &impl serde::Serialize) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn error_json(error: &ChainError) -> Value {
    let origin = error.origin.as_ref().map(|o| o.to_string());
    json!({ "kind": error.kind, "message": error.message, "origin": origin })
}

/// JSON text as shown: through the token transforms, then parsed again
/// (as a string if a transform left it no longer JSON).
async fn shown_json(shown: &Shown<'_>, text: &str) -> Result<Value, ChainError> {
    let text = shown.text(text).await?;
    Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

async fn done_json(done: &TurnDone, shown: &Shown<'_>) -> Result<Value, ChainError> {
    let mut calls = Vec::with_capacity(done.tool_calls.len());
    for record in &done.tool_calls {
        let output = match record.output.as_deref() {
            Some(output) => Some(shown_json(shown, output).await?),
            None => None,
        };
        calls.push(json!({
            "name": record.call.name,
            "arguments": shown_json(shown, &record.call.arguments).await?,
            "output": output,
            "error": record.error.as_ref().map(error_json),
        }));
    }
    let mut messages = Vec::with_capacity(done.messages.len());
    for message in done.messages.iter() {
        messages.push(shown.message(message).await?);
    }
    Ok(json!({
        "text": shown.text(&done.response.text()).await?,
        "finish_reason": done.response.finish_reason,
        "usage": done.response.usage,
        "metadata": done.response.metadata,
        "tool_calls": calls,
        "iterations": done.iterations,
        "messages": messages,
    }))
}

/// A turn result as JSON, for `--json`, its texts as shown.
async fn to_json(result: &TurnResult, shown: &Shown<'_>) -> Result<Value, ChainError> {
    Ok(match result {
        TurnResult::Done(done) => json!({ "done": done_json(done, shown).await? }),
        TurnResult::Interrupt(interrupt) => {
            json!({ "interrupt": { "kind": interrupt.kind.as_str(), "reason": interrupt.reason, "pending": interrupt.pending } })
        }
        TurnResult::Error(error) => json!({ "error": error_json(error) }),
    })
}

/// The innermost filter of `shallot chat`: shows each tool call as it
/// happens, as the tool finally sees it.
struct ShowTools;

#[async_trait]
impl Filter for ShowTools {
    fn name(&self) -> &str {
        "shallot-chat-show-tools"
    }

    fn hooks(&self) -> &[Hook] {
        &[Hook::AroundTool]
    }

    async fn around_tool(
        &self,
        request: ToolRequest,
        next: Next<Tool>,
    ) -> Result<ToolResponse, ChainError> {
        let call = format!("{}({})", request.tool.name, request.arguments);
        let result = next.call(request).await;
        let said = match &result {
            Ok(response) => format!("  [tool] {call} -> {}", response.output),
            Err(error) => format!("  [tool] {call} failed: {}", error.message),
        };
        eprintln!("{}", shallot::terminal_text(&said));
        result
    }
}

/// An answer's text as it goes to stdout: at a terminal, with nothing in
/// it that could move the cursor or forge a line (a model's or a filter's
/// words); into a pipe or a file, exactly as it is.
fn for_stdout(text: &str) -> std::borrow::Cow<'_, str> {
    if std::io::stdout().is_terminal() {
        shallot::terminal_text(text).into()
    } else {
        text.into()
    }
}

/// Asks the person at the terminal, one question at a time, when a filter
/// granted the `approval` import asks (installed only when stdin and
/// stderr are a terminal; otherwise every question is answered no).
#[derive(Default)]
struct TerminalApprover {
    asking: tokio::sync::Mutex<()>,
}

#[async_trait]
impl Approver for TerminalApprover {
    async fn approve(&self, request: &ApprovalRequest) -> bool {
        let _one_at_a_time = self.asking.lock().await;
        // The question is the filter's words: shown so that none of them
        // can clear the screen, rewrite the prompt or forge a line.
        let question = format!(
            "{} asks to run {}({}): {}.",
            request.filter, request.tool, request.arguments, request.reason
        );
        eprint!("\n{} Allow? [y/N] ", shallot::terminal_text(&question));
        matches!(read_line().await, Ok(Some(line)) if approves(&line))
    }
}

/// The lines of stdin, read by one thread for the whole process: a prompt
/// and every approval question take the next line from it. A question the
/// filter stops waiting for reads nothing then, and leaves no thread
/// blocked on stdin to swallow a later line.
type Lines = tokio::sync::Mutex<tokio::sync::mpsc::Receiver<std::io::Result<String>>>;

/// The next line of stdin; `None` at its end.
async fn read_line() -> std::io::Result<Option<String>> {
    static LINES: OnceLock<Lines> = OnceLock::new();
    let lines = LINES.get_or_init(|| {
        let (sender, receiver) = tokio::sync::mpsc::channel(1);
        std::thread::spawn(move || {
            loop {
                let mut line = String::new();
                let read = std::io::stdin().read_line(&mut line).map(|_| line);
                let last = !matches!(&read, Ok(line) if !line.is_empty());
                if sender.blocking_send(read).is_err() || last {
                    break;
                }
            }
        });
        tokio::sync::Mutex::new(receiver)
    });
    match lines.lock().await.recv().await {
        Some(Ok(line)) if !line.is_empty() => Ok(Some(line)),
        Some(Err(e)) => Err(e),
        _ => Ok(None),
    }
}

/// Whether a person's answer is a yes.
fn approves(answer: &str) -> bool {
    matches!(answer.trim().to_lowercase().as_str(), "y" | "yes")
}

#[cfg(test)]
mod tests {
    use super::approves;

    #[test]
    fn only_a_yes_approves() {
        for yes in ["y", "Y\n", " yes "] {
            assert!(approves(yes), "{yes:?}");
        }
        for no in ["", "\n", "n", "no", "yes please", "sure"] {
            assert!(!approves(no), "{no:?}");
        }
    }
}
