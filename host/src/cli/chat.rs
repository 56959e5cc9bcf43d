//! `shallot chat`: prompts through the filters to the model.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Args;
use shallot::types::{ChatRequest, ChatResponse, FinishReason, Message};
use shallot::{Context, EmbeddedModel, Engine, Kernel};

use super::Source;

#[derive(Args)]
pub(crate) struct ChatArgs {
    #[command(flatten)]
    source: Source,
    /// Stream each answer token by token, through the filters' token transforms.
    #[arg(long)]
    stream: bool,
    /// Print each response as a JSON object instead of its text.
    #[arg(long)]
    json: bool,
    /// Pause between the embedded model's streamed tokens, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pace: u64,
    /// The prompts. Several are sent one after another as one conversation.
    #[arg(required = true, value_name = "PROMPT")]
    prompts: Vec<String>,
}

pub(crate) async fn run(engine: &Engine, args: ChatArgs) -> anyhow::Result<ExitCode> {
    let plugins = args.source.load(engine).await?;
    let model = EmbeddedModel::new().with_delay(Duration::from_millis(args.pace));
    let kernel = Kernel::builder().plugins(&plugins).model(model).build()?;
    let mut conversation = Vec::new();
    let several = args.prompts.len() > 1;
    for prompt in &args.prompts {
        if several && !args.json {
            println!("> {prompt}");
        }
        conversation.push(Message::user(prompt.as_str()));
        let request = ChatRequest::new(conversation.clone());
        let response = if args.stream && !args.json {
            let printed = Arc::new(AtomicBool::new(false));
            let seen = printed.clone();
            let streamed = kernel
                .chat_stream(
                    request,
                    Context::new(),
                    move |token: shallot::types::Token<'_>| {
                        seen.store(true, Ordering::Relaxed);
                        print!("{}", token.text);
                        let _ = std::io::stdout().flush();
                    },
                )
                .await?;
            // A filter that answered itself (a safeguard block) streamed nothing.
            if !printed.load(Ordering::Relaxed) {
                print!("{}", streamed.text());
            }
            println!();
            streamed
        } else {
            let response = kernel.chat(request, Context::new()).await?;
            if args.json {
                println!("{}", to_json(&response));
            } else {
                println!("{}", response.text());
            }
            response
        };
        if response.finish_reason != FinishReason::Complete && !args.json {
            eprintln!(
                "[finish reason: {}]",
                serde_json::to_value(response.finish_reason)?
                    .as_str()
                    .unwrap_or("?")
            );
        }
        conversation.push(response.message);
    }
    Ok(ExitCode::SUCCESS)
}

fn to_json(response: &ChatResponse) -> serde_json::Value {
    serde_json::json!({
        "text": response.text(),
        "message": response.message,
        "finish_reason": response.finish_reason,
        "usage": response.usage,
        "model": response.model,
        "metadata": response.metadata,
    })
}
